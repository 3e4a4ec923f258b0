"""How one model is split over many devices, apart from which devices they are: the mesh's axes
(data, fsdp, tensor) and their arithmetic (``mesh``), the tensor-parallel split of a model's layers
(``tensor``), decoder layers run as one scanned block on XLA (``scan``), and the environment of a
run over several TPU slices (``slices``). The runtimes apply them; the driver checks them first.
"""
