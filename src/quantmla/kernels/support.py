"""What the kernels read: the page layouts they support (checked before any launch), the constants a layout gives
them (its sections' offsets, code widths, groups and metadata kinds as Triton constexprs) and the views of a layer's
pages they read through."""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.kernels.schedule import _pow2
from quantmla.quant.format import PathFormat

KERNEL_BITS = (2, 4, 8)
MAX_D_C = 512
MAX_D_R = 128


def path_args(fmt: PathFormat, dim: int, path: str) -> tuple[int, int, bool, bool]:
    """(bits, group size, affine, bf16 metadata) of a path, or UnsupportedFormatError."""
    if not fmt.quantized:
        return 16, dim, True, False
    if fmt.mode == "fp8":
        fmt.check_dim(dim, path)
        if not _pow2(dim // fmt.group_size):
            raise UnsupportedFormatError(f"{path}: the kernels need a power-of-two number of FP8 groups, got {dim // fmt.group_size}")
        return 8, fmt.group_size, False, fmt.meta_dtype == "bfloat16"
    if fmt.bits not in KERNEL_BITS:
        raise UnsupportedFormatError(
            f"{path}: the Triton kernels take {KERNEL_BITS}-bit codes or BF16, not {fmt.bits}-bit "
            "(3-bit packing is a CPU/accuracy format)"
        )
    if fmt.mode not in ("affine", "symmetric"):
        raise UnsupportedFormatError(f"{path}: unknown mode {fmt.mode!r}")
    fmt.check_dim(dim, path)
    return fmt.bits, fmt.group_size, fmt.mode == "affine", fmt.meta_dtype == "bfloat16"


def check_layout_supported(layout: PageLayout) -> None:
    """Raise UnsupportedFormatError unless the decode and append kernels can run `layout`."""
    if not isinstance(layout, PageLayout):
        raise QuantMLAError(f"expected a cache.layout.PageLayout, got {type(layout).__name__}")
    tok = layout.token
    if not (_pow2(tok.d_c) and 16 <= tok.d_c <= MAX_D_C):
        raise UnsupportedFormatError(f"the kernels need a power-of-two latent rank d_c in [16, {MAX_D_C}], got {tok.d_c}")
    if not (_pow2(tok.d_r) and 16 <= tok.d_r <= MAX_D_R):
        raise UnsupportedFormatError(f"the kernels need a power-of-two RoPE dim d_r in [16, {MAX_D_R}], got {tok.d_r}")
    path_args(tok.fmt.content, tok.d_c, "content path")
    path_args(tok.fmt.rope, tok.d_r, "RoPE path")
    if layout.page_bytes % 16:
        raise UnsupportedFormatError("page size in bytes must be a multiple of 16")  # layout guarantees it


def layout_constexprs(layout: PageLayout) -> dict:
    tok = layout.token
    cb, cg, ca, cbf = path_args(tok.fmt.content, tok.d_c, "content path")
    rb, rg, ra, rbf = path_args(tok.fmt.rope, tok.d_r, "RoPE path")
    o = layout.offsets
    r_page = layout.rope_meta_block  # tokens a RoPE metadata set of the page serves (0: per-token metadata)
    return dict(
        D_C=tok.d_c, D_R=tok.d_r, PS=layout.page_size, PAGE_BYTES=layout.page_bytes,
        OFF_CC=o["content_codes"], OFF_RC=o["rope_codes"], OFF_CM=o["content_meta"],
        OFF_RM=o["rope_page_meta"] if r_page else o["rope_meta"], R_PAGE=r_page,
        C_BITS=cb, C_GS=cg, C_AFFINE=ca, C_FP8=tok.fmt.content.mode == "fp8" and tok.fmt.content.quantized,
        C_MB=tok.fmt.content.meta_elem_bytes,
        R_BITS=rb, R_GS=rg, R_AFFINE=ra, R_FP8=tok.fmt.rope.mode == "fp8" and tok.fmt.rope.quantized,
        R_MB=tok.fmt.rope.meta_elem_bytes,
    ), (cbf, rbf)


def page_views(pages: torch.Tensor, layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 pages plus the 16-bit views the content and RoPE sections are read through."""
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != layout.page_bytes:
        raise QuantMLAError(
            f"kv_pages must be one layer's uint8 [num_pages, {layout.page_bytes}] pages, got {pages.dtype} {tuple(pages.shape)}"
        )
    if not pages.is_contiguous():
        raise QuantMLAError("kv_pages must be contiguous (one layer of PagePool.data)")

    def view(fmt: PathFormat) -> torch.Tensor:  # the path's 16-bit values, or its metadata's dtype
        return pages.view(torch.bfloat16 if not fmt.quantized else fmt.torch_meta_dtype)

    return pages, view(layout.token.fmt.content), view(layout.token.fmt.rope)
