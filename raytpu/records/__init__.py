"""The records both sides of a run read and write: checkpoint files and which ones a run keeps, the
goodput record, the batch the finder settled on, and the stop request. The driver imports these
and the workers' one entry, never other worker internals."""
