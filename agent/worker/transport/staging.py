"""Tensors the mesh cannot read or fill in place travel through a host copy.

The mesh moves bytes between sockets and a tensor's own memory (`mesh.byte_view`), which
exists only for a contiguous CPU tensor. A GPU job whose members cannot all accept
connections runs this transport too (NCCL dials every peer directly), so its activations,
gradients and buckets live on the GPU; a strided view (a transpose, a slice of a bucket) has
no single run of bytes either. Rather than a second path in the worker, every such tensor is
staged here, once per message:

- outgoing: copied into a fresh contiguous host tensor when the send is posted, so the bytes
  sent are the tensor's value at `isend` time, as NCCL's and gloo's are (a CUDA-to-host copy
  from pageable memory waits for the kernels already queued on the tensor's stream);
- incoming: received into a contiguous host buffer, then copied into the caller's tensor by
  the thread that completes the receive, before its `Work` reports done, so `wait()` returning
  means the tensor holds the message (on the GPU, a host-to-device `copy_` from pageable
  memory returns when the copy has landed).

The price is one extra copy each way; for a GPU job it is a PCIe copy per message, small
against a WAN link. A contiguous CPU tensor (every gloo-sized CPU job) is never copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def in_place(t: torch.Tensor) -> bool:
    """Whether the mesh can read and write `t`'s own memory (a contiguous CPU tensor)."""
    return t.device.type == "cpu" and t.is_contiguous()


def outgoing(t: torch.Tensor) -> torch.Tensor:
    """What to put on the wire for a send of `t`: `t` itself, or a contiguous host copy of
    its value now."""
    if in_place(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())


def incoming(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Where to receive a message for `t`, and what to run once it arrived (None: it lands
    in `t` directly): a contiguous host buffer of `t`'s shape and dtype, copied into `t`."""
    if in_place(t):
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")

    def land() -> None:
        with torch.no_grad():
            t.copy_(host)
    return host, land
