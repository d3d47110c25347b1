"""The binding layer: Pythonic owners of llama.cpp's and mtmd's native objects.

Model, Context (+ Memory), Sampler, Batch, Projector, Bitmap, Chunks, the devices' native
half. The only modules, with ``_native``, that call ``ffi``/``lib``; each native pointer is
owned by one NativeHandle, and native return codes become exceptions from ``errors``.
Above this layer everything speaks numpy arrays, Python ints and dataclasses.
"""
