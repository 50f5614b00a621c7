"""The image options that `ctxfuse serve` and `ctxfuse edge` share: caps checked before any image is
decoded, and the hosts remote image URLs may be fetched from (none by default)."""

from __future__ import annotations

import argparse

from edge.vision.features import VisionOptions


def _hosts(text: str) -> list[str]:
    hosts = [h.strip().lower() for h in text.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError("expected host[:port] names, comma-separated")
    return hosts


def add_image_options(p: argparse.ArgumentParser) -> None:
    d = VisionOptions()
    g = p.add_argument_group("images (image_url parts become features: labels, embedding, OCR text)")
    g.add_argument(
        "--allow-image-urls",
        type=_hosts,
        action="extend",
        default=[],
        metavar="HOST[:PORT],...",
        help="fetch http(s) image URLs from these hosts only (repeatable; default: none, data: URLs only)",
    )
    g.add_argument(
        "--max-image-mib",
        type=float,
        default=d.max_image_bytes / 2**20,
        help=f"larger images are refused before decoding (default {d.max_image_bytes / 2**20:g})",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help=f"images declaring more pixels are refused before decoding (default {d.max_image_pixels})",
    )
    g.add_argument(
        "--image-encoder",
        choices=["int8", "fp32"],
        default=d.precision,
        help=f"the encoder's precision (default {d.precision})",
    )


def ensure_vision_files() -> None:
    """Build the encoder's files before serving if they are missing (once; `make serve` has done it
    through `ctxfuse models fetch`), so the first image is not the one that waits for them."""
    from edge.vision.model_files import ensure

    ensure()


def vision_options(args: argparse.Namespace) -> VisionOptions:
    return VisionOptions(
        max_image_bytes=int(args.max_image_mib * 2**20),
        max_image_pixels=args.max_image_pixels,
        allowed_image_hosts=tuple(args.allow_image_urls),
        precision=args.image_encoder,
    )
