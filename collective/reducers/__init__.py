"""The data-parallel exchanges the trainer drives (models/run/exchange.py's Exchange):
plain bucketed averaging, local SGD / DiLoCo and Streaming DiLoCo, compression, 1-bit
Adam, the quantized ring, and the method flags that choose among them."""
