"""A PIL image of any mode to the RGB uint8 pixels mtmd takes (no native imports here).

Pillow's ``convert("RGB")`` clips the integer and float modes to 0..255, so a 16-bit
grayscale PNG (mode ``I;16``, or ``I`` in some Pillow versions) comes out almost all white.
Those modes are scaled to 0..255 here instead; every other mode goes through Pillow.
"""

from __future__ import annotations

import numpy as np

_U16_MAX = 65535


def to_rgb8(im) -> np.ndarray:
    """The pixels of PIL image ``im`` as a C-contiguous uint8 array [height, width, 3].

    ``I;16*`` modes are scaled by 255/65535. ``I`` (32-bit int) is kept as is when within
    0..255, scaled by 255/65535 when within 0..65535, else min-max normalised. ``F`` (float)
    is scaled by 255 when within 0..1, kept when within 0..255, else min-max normalised.
    Any other mode is Pillow's ``convert("RGB")`` (``La`` by way of ``LA``).
    """
    mode = im.mode
    if mode.startswith("I;16"):
        gray = _scale_u16(np.asarray(im).astype(np.int64))
    elif mode == "I":
        a = np.asarray(im).astype(np.int64)
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
        if lo >= 0 and hi <= 255:
            gray = a.astype(np.uint8)
        elif lo >= 0 and hi <= _U16_MAX:
            gray = _scale_u16(a)
        else:
            gray = _min_max(a.astype(np.float64))
    elif mode == "F":
        a = np.asarray(im).astype(np.float64)
        finite = a[np.isfinite(a)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        # NaN is black and the infinities the extremes, so that one bad pixel spoils no other
        a = np.nan_to_num(a, nan=min(lo, 0.0), posinf=hi, neginf=lo)
        if lo >= 0.0 and hi <= 1.0:
            gray = np.rint(a * 255.0).astype(np.uint8)
        elif lo >= 0.0 and hi <= 255.0:
            gray = np.rint(a).astype(np.uint8)
        else:
            gray = _min_max(a)
    else:
        if mode == "La":  # Pillow has no La -> RGB; LA undoes the premultiplied alpha, as RGBa -> RGB does
            im = im.convert("LA")
        return np.ascontiguousarray(np.asarray(im.convert("RGB")), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


def _scale_u16(a: np.ndarray) -> np.ndarray:
    # rounded integer arithmetic: 32768 -> 128, 65535 -> 255
    return ((a * 255 + _U16_MAX // 2) // _U16_MAX).astype(np.uint8)


def _min_max(a: np.ndarray) -> np.ndarray:
    lo, hi = float(a.min()), float(a.max())
    if hi <= lo:  # one value everywhere: there is no range to stretch
        return np.full(a.shape, int(np.clip(round(lo), 0, 255)), dtype=np.uint8)
    return np.rint((a - lo) * (255.0 / (hi - lo))).astype(np.uint8)
