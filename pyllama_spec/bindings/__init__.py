"""The binding layer: Pythonic owners of llama.cpp's and mtmd's native objects.

handle.py (NativeHandle), model.py (Model), context.py (Context, Memory), lora.py
(LoraAdapter), sampler.py (Sampler), batch.py (Batch), mtmd.py (Projector, Bitmap, Chunks), devices.py (the devices'
native half), native_info.py (what the build says of itself). The only modules, with ``_native``, that call ``ffi``/``lib``; each native pointer is
owned by one NativeHandle, and native return codes become exceptions from ``errors``.
Above this layer everything speaks numpy arrays, Python ints and dataclasses.
"""
