"""Text corpora of the user's (``data.train_files``): found and read in the formats users have
(``sources``), tokenized by the job's tokenizer and packed into fixed-length blocks (``packing``),
counted once into an index (``index``), then either tokenized into files for the torch path
(``tokens``) or streamed by Ray Data in an order every worker, attempt and size agrees on
(``order``, ``pipeline``, ``feeder``, ``stream``); what the driver does of it, ``prepare``."""
