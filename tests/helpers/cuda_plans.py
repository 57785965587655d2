"""What the CUDA plan tests share: a decode plan made for a layout on a mocked sm_90 device, without a GPU."""

from unittest import mock

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import cuda

CUDA = torch.device("cuda")


def plan(name_or_fmt, rows=16, page=64, out=torch.bfloat16, d_c=512, d_r=64, **tiling):
    """(layout, ``cuda.decode_plan`` of it for `rows` query rows on sm_90): a preset's name or a CacheFormat."""
    fmt = preset(name_or_fmt) if isinstance(name_or_fmt, str) else name_or_fmt
    lay = PageLayout(TokenLayout(d_c, d_r, fmt), page)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        return lay, cuda.decode_plan(lay, rows, out, CUDA, **tiling)
