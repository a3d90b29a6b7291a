"""The tensor table: a zero-copy load of a plain state dict without a rebuild call per tensor.
``table`` encodes and loads it, ``columns`` packs its dense tensors' columns, ``tensors``
makes the tensors of its columns in bulk."""
