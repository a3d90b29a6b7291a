"""CUDA tensors into and out of segments: the copies (``copy``), the mappings registered as
page-locked memory (``pinning``) and a load's staging buffers (``staging``)."""
