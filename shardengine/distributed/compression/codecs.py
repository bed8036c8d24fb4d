"""Compressed collectives as pure tensor math: fewer bytes on the wire, bounded error.

Nothing here talks to other processes. Each collective is split into what one
rank does before sending (``encode_*``) and after receiving (``decode_*``), so
the engine can put a real all-to-all / all-gather between them; the
``simulate_*`` functions compose the two over a list of per-rank tensors (rank
r's input at index r) so the math is checked in one process. Results are
*sums* in fp32, like :class:`shardengine.distributed.communicator.Communicator`: callers divide.

[Note: block-wise int8 quantization]
A flat tensor is cut into blocks of ``block_size`` elements (the last one may
be shorter). Each block sends its max |x| as an fp32 scale and every element as
``round(127 * x / max)`` in int8, so an element comes back within half a step,
max/254, of its value (up to fp32 rounding; see :func:`error_bound`), which is
the issue's max/127 with a factor 2 to spare. Smaller blocks follow the local
magnitude more closely; each block costs 4 bytes of scale on top of its payload.

[Note: non-finite values]
A block holding inf or NaN cannot be scaled: it is sent with a NaN scale and
comes back as all NaN, so an fp16 overflow stays visible after the reduction
(the loss scaler then skips the step, as it does without compression); other
blocks are unaffected. Error feedback never takes NaN into its residual.

[Note: the all-to-all reduce-scatter (qgZ)]
A ring reduce-scatter of quantized data would dequantize, add and re-quantize
at every one of its N-1 steps, so the error grows with N. As in ZeRO++'s qgZ,
each rank instead quantizes the chunk owned by each other rank once, sends it
straight there (one all-to-all), and the owner dequantizes the N-1 chunks and
sums them, plus its own chunk untouched, in fp32: one quantization per value,
the same (N-1)/N of the buffer on the wire per rank. (qgZ adds an intra-node
hop first; a single hop is what a flat group needs.)

[Note: one compute copy on every rank]
A quantized all-gather dequantizes the owner's shard too, instead of using the
exact one, so every rank computes with bit-identical weights; otherwise each
replica would run a slightly different model and their gradients would not be
gradients of one function.

Bad settings (block size, wire dtype) raise :class:`ConfigError`; tensors of the
wrong shape or dtype raise ``ValueError``.

>>> grads = [torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.tensor([0.5, 0.5, -1.0, 2.0])]
>>> [[round(v, 3) for v in s.tolist()] for s in simulate_quantized_reduce_scatter(grads, block_size=2)]
[[1.5, -1.5], [1.992, 6.0]]

The exact sums are [1.5, -1.5] and [2.0, 6.0]: rank 0's 3.0 went over the wire
in a block of max 4.0, as 95/127 of it; its error is within 4.0/254.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..traffic import ring_bytes
from ...errors import ConfigError

INT8_MAX = 127
SCALE_BYTES = 4  # one fp32 scale per block
DEFAULT_BLOCK_SIZE = 256  # scales add 4/256 = 1.6% to the int8 payload
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIRE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


# --------------------------------------------------------------------------- int8 blocks


@dataclass(frozen=True)
class QuantizedBlocks:
    """A flat tensor as int8 ``values`` and one fp32 scale (the block's max |x|) per block."""

    values: torch.Tensor
    scales: torch.Tensor
    block_size: int

    @property
    def numel(self) -> int:
        return self.values.numel()

    @property
    def nbytes(self) -> int:
        """Bytes this message takes on the wire (payload and scales)."""
        return payload_bytes(self.numel, self.block_size)


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // check_block_size(block_size))


def payload_bytes(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of ``numel`` elements quantized to int8: one byte each plus an fp32 scale per block.

    >>> payload_bytes(1000, block_size=256)   # 1000 + 4 blocks * 4
    1016
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return numel + SCALE_BYTES * num_blocks(numel, block_size)


def _check_flat(x: torch.Tensor, what: str = "tensor") -> None:
    if not torch.is_tensor(x) or x.dim() != 1:
        raise ValueError(f"{what} must be a 1-D (flat) tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {x.dtype}")


def _as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, one block per row (a view when nothing is padded)."""
    padding = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if padding:
        flat = torch.nn.functional.pad(flat, (0, padding))
    return flat.reshape(-1, block_size)


def quantize_blockwise(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedBlocks:
    """Quantize a flat tensor to int8 with one scale per block (see the Notes above).

    >>> q = quantize_blockwise(torch.tensor([0.0, 1.0, -2.0, 0.5, 0.25]), block_size=2)
    >>> q.values.tolist(), q.scales.tolist()
    ([0, 127, -127, 32, 127], [1.0, 2.0, 0.25])
    >>> dequantize_blockwise(q).tolist()
    [0.0, 1.0, -2.0, 0.5039370059967041, 0.25]
    """
    _check_flat(x)
    blocks = _as_blocks(x.detach().to(torch.float32), check_block_size(block_size))
    block_max = blocks.abs().amax(dim=1)  # inf or NaN where the block holds one
    finite = torch.isfinite(block_max)
    # Per block: finite blocks divide by their max (1 if all zero), the others by inf,
    # which sends finite values to 0 and inf/NaN to NaN, zeroed below.
    divisor = torch.where(finite, torch.where(block_max > 0, block_max, 1.0), math.inf)
    # x / max first, then * 127: no overflow at fp32's max, no underflow of max / 127.
    # |x| <= max, and both roundings are monotone, so the steps stay within +-127.
    steps = (blocks / divisor[:, None]).mul_(INT8_MAX).round_().nan_to_num_(0.0)
    values = steps.to(torch.int8).view(-1)[: x.numel()]
    scales = torch.where(finite, block_max, math.nan)
    return QuantizedBlocks(values, scales, block_size)


def dequantize_blockwise(quantized: QuantizedBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a receiver reconstructs from ``quantized``, as a flat ``dtype`` tensor."""
    blocks = _as_blocks(quantized.values.to(torch.float32), quantized.block_size)
    values = blocks.div_(INT8_MAX).mul_(quantized.scales[:, None]).view(-1)[: quantized.numel]
    return values.to(dtype)


def error_bound(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Per element of ``x``: the most its quantize/dequantize round trip can be off.

    Half a step (block max / 254) plus fp32 rounding: 1e-4 of that, and half the
    smallest subnormal for blocks whose values are themselves subnormal. Below
    max/127 except where the block max is subnormal (< 3.6e-43).
    """
    _check_flat(x)
    blocks = _as_blocks(x.detach().to(torch.float32).abs(), check_block_size(block_size))
    block_max = blocks.amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)[: x.numel()]
    return block_max / (2 * INT8_MAX) * (1 + 1e-4) + 2.0 ** -149


def pack(quantized: QuantizedBlocks) -> torch.Tensor:
    """One uint8 buffer (int8 payload, then the fp32 scales) for a single send.

    >>> q = quantize_blockwise(torch.arange(5.0), block_size=4)
    >>> buffer = pack(q); buffer.numel() == q.nbytes
    True
    >>> torch.equal(unpack(buffer, 5, block_size=4).values, q.values)
    True
    """
    return torch.cat([quantized.values.view(torch.uint8), quantized.scales.contiguous().view(torch.uint8)])


def unpack(buffer: torch.Tensor, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedBlocks:
    """Inverse of :func:`pack` for a message of ``numel`` elements."""
    if buffer.dtype != torch.uint8 or buffer.numel() != payload_bytes(numel, block_size):
        raise ValueError(f"expected {payload_bytes(numel, block_size)} uint8 bytes for {numel} elements "
                         f"in blocks of {block_size}, got {buffer.numel()} {buffer.dtype}")
    values = buffer[:numel].view(torch.int8)
    scales = buffer[numel:].clone().view(torch.float32)  # clone: the offset may not be 4-byte aligned
    return QuantizedBlocks(values, scales, block_size)


# --------------------------------------------------------------------------- error feedback


class ErrorFeedback:
    """The residual of one flat buffer: what earlier steps could not send.

    Each step sends ``x + residual`` and keeps what that lost. The transmitted
    total over k steps is the true total minus the last residual, and the
    residual stays within half a quantization step of what was sent, so the
    accumulated error is bounded instead of growing with k. The residual is in
    the units of the input: feed it unscaled gradients, or :meth:`rescale` it
    when an fp16 loss scale changes.

    Where a block was sent as NaN (non-finite input) the residual keeps its old
    value. On a step the loss scaler skips because *another* rank overflowed,
    the finite blocks' residuals still advance: a one-step, bounded deviation;
    undoing it would need a second fp32 copy (``state_dict`` before the step).

    >>> feedback = ErrorFeedback(3)
    >>> sent = [dequantize_blockwise(feedback.quantize(torch.tensor([1.0, 0.3, 0.001]), 4))
    ...         for _ in range(100)]
    >>> abs(sum(sent)[2].item() / 100 - 0.001) < 1e-4   # without feedback 0.001 rounds to 0 every step
    True
    """

    def __init__(self, numel: int, device: Optional[torch.device] = None):
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)

    def compensate(self, x: torch.Tensor) -> torch.Tensor:
        """This step's input plus what earlier steps owe, in fp32 (a new tensor)."""
        _check_flat(x, "input")
        if x.shape != self.residual.shape:
            raise ValueError(f"error feedback holds {self.residual.numel()} elements, got {x.numel()}")
        return x.to(torch.float32) + self.residual

    def record_sent(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep what the receivers did not get: ``compensated - sent``, except where ``sent`` is NaN."""
        kept = compensated - sent  # NaN exactly where a block was sent as NaN
        self.residual = torch.where(kept.isnan(), self.residual, kept)

    def rescale(self, factor: float) -> None:
        """Follow a change of units, e.g. an fp16 loss scale multiplied by ``factor``."""
        self.residual.mul_(factor)

    def quantize(self, x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedBlocks:
        """Compensate, quantize and record in one call."""
        compensated = self.compensate(x)
        quantized = quantize_blockwise(compensated, block_size)
        self.record_sent(compensated, dequantize_blockwise(quantized))
        return quantized

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"residual of {residual.numel()} elements for a buffer of {self.residual.numel()}")
        self.residual = residual.to(self.residual)


# --------------------------------------------------------------------------- int8 reduce-scatter


def split_chunks(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``flat`` as ``world`` equal chunks (views); chunk r is what rank r owns."""
    if world < 1 or flat.numel() % world:
        raise ValueError(f"a buffer of {flat.numel()} elements does not split into {world} equal chunks "
                         "(flat buffers are padded to a multiple of the world size)")
    return list(flat.view(world, -1).unbind(0))


def encode_reduce_scatter(flat: torch.Tensor, rank: int, world: int, block_size: int = DEFAULT_BLOCK_SIZE,
                          feedback: Optional[ErrorFeedback] = None) -> list[Optional[QuantizedBlocks]]:
    """What ``rank`` sends to each rank: the chunk that rank owns, quantized once.

    The entry for ``rank`` itself is None: its own chunk never crosses the wire
    and is summed exactly, so its residual stays 0.
    """
    compensated = feedback.compensate(flat) if feedback else flat
    chunks = split_chunks(compensated, world)
    messages = [None if dest == rank else quantize_blockwise(chunk, block_size) for dest, chunk in enumerate(chunks)]
    if feedback:
        sent = [chunk if m is None else dequantize_blockwise(m) for chunk, m in zip(chunks, messages)]
        feedback.record_sent(compensated, torch.cat(sent))
    return messages


def decode_reduce_scatter(own_chunk: torch.Tensor,
                          received: Sequence[Optional[QuantizedBlocks]]) -> torch.Tensor:
    """The owner's sum in fp32: its own chunk exactly, every other rank's dequantized, in rank order."""
    total = torch.zeros(own_chunk.numel(), dtype=torch.float32, device=own_chunk.device)
    for message in received:
        total += own_chunk if message is None else dequantize_blockwise(message)
    return total


def all_to_all(messages: Sequence[Sequence]) -> list[list]:
    """``messages[src][dest]`` delivered: the result's ``[dest][src]``."""
    return [list(column) for column in zip(*messages)]


def simulate_quantized_reduce_scatter(inputs: Sequence[torch.Tensor], block_size: int = DEFAULT_BLOCK_SIZE,
                                      feedbacks: Optional[Sequence[ErrorFeedback]] = None) -> list[torch.Tensor]:
    """Each rank's reduced chunk (a sum, fp32) from the all-to-all formulation, for N = len(inputs)."""
    world = len(inputs)
    sent = [encode_reduce_scatter(x, rank, world, block_size, feedbacks[rank] if feedbacks else None)
            for rank, x in enumerate(inputs)]
    return [decode_reduce_scatter(split_chunks(inputs[rank], world)[rank].to(torch.float32), received)
            for rank, received in enumerate(all_to_all(sent))]


def quantized_reduce_scatter_bytes(numel: int, world: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one rank sends in the int8 all-to-all reduce-scatter of ``numel`` elements.

    >>> quantized_reduce_scatter_bytes(4096, world=4, block_size=256)   # 3 chunks of 1024 + 4 scales
    3120
    >>> ring_bytes("reduce_scatter", 4096 * 4, 4)                       # the same in fp32
    12288
    """
    _check_divisible(numel, world)
    return (world - 1) * payload_bytes(numel // world, block_size)


def _check_divisible(numel: int, world: int) -> None:
    if world < 1 or numel < 0 or numel % world:
        raise ValueError(f"{numel} elements do not split into {world} equal chunks")


# --------------------------------------------------------------------------- int8 all-gather


def encode_all_gather(shard: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedBlocks:
    """What a rank sends of its shard: quantized once (the fp32 master stays exact)."""
    return quantize_blockwise(shard, block_size)


def decode_all_gather(received: Sequence[QuantizedBlocks], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full flat tensor from every rank's message, its own included (see the Note)."""
    return torch.cat([dequantize_blockwise(message, dtype) for message in received])


def simulate_quantized_all_gather(shards: Sequence[torch.Tensor], block_size: int = DEFAULT_BLOCK_SIZE,
                                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank's gathered full tensor (identical on all ranks).

    >>> full = simulate_quantized_all_gather([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.1])], 2)
    >>> torch.equal(full[0], full[1]), [round(v, 4) for v in full[0].tolist()]
    (True, [1.0079, 2.0, 3.0, 0.0945])
    """
    sizes = {shard.numel() for shard in shards}
    if len(sizes) > 1:
        raise ValueError(f"all-gather needs equal shards, got sizes {sorted(sizes)}")
    messages = [encode_all_gather(shard, block_size) for shard in shards]
    return [decode_all_gather(messages, dtype) for _ in shards]


def quantized_all_gather_bytes(numel: int, world: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one rank sends to all-gather ``numel`` elements (the full tensor) as int8 shards.

    >>> quantized_all_gather_bytes(4096, world=4, block_size=256)
    3120
    """
    _check_divisible(numel, world)
    return ring_bytes("all_gather", world * payload_bytes(numel // world, block_size), world)


# --------------------------------------------------------------------------- int8 all-reduce (stage 0)


def simulate_quantized_all_reduce(inputs: Sequence[torch.Tensor], block_size: int = DEFAULT_BLOCK_SIZE,
                                  feedbacks: Optional[Sequence[ErrorFeedback]] = None,
                                  shard_feedbacks: Optional[Sequence[ErrorFeedback]] = None) -> list[torch.Tensor]:
    """An all-reduce as the int8 reduce-scatter above, then an int8 all-gather of each sum.

    ``shard_feedbacks[r]`` (the size of one chunk) lets owner r carry the second
    quantization's residual too, as 1-bit Adam's server-side error does.
    """
    reduced = simulate_quantized_reduce_scatter(inputs, block_size, feedbacks)
    if shard_feedbacks:
        messages = [fb.quantize(chunk, block_size) for fb, chunk in zip(shard_feedbacks, reduced)]
    else:
        messages = [encode_all_gather(chunk, block_size) for chunk in reduced]
    return [decode_all_gather(messages) for _ in inputs]


def quantized_all_reduce_bytes(numel: int, world: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    return quantized_reduce_scatter_bytes(numel, world, block_size) + quantized_all_gather_bytes(
        numel, world, block_size)


# --------------------------------------------------------------------------- bf16 / fp16 reduction


@dataclass(frozen=True)
class CastPolicy:
    """Dtypes of a low-precision reduction: values cross the wire in ``wire`` (rounded once,
    by the sender); receivers upcast and sum in ``accumulate``; the result stays in ``result``,
    the dtype the fp32 master gradients are accumulated in."""

    wire: torch.dtype
    accumulate: torch.dtype = torch.float32
    result: torch.dtype = torch.float32


def cast_policy(wire: Union[str, torch.dtype]) -> CastPolicy:
    """The policy for a ``"bf16"`` or ``"fp16"`` wire.

    fp16 has a narrow range: values above 65504 arrive as inf (the loss scaler's
    overflow check then skips the step), below ~6e-8 as 0, so use it with loss scaling.

    >>> cast_policy("bf16")
    CastPolicy(wire=torch.bfloat16, accumulate=torch.float32, result=torch.float32)
    """
    if isinstance(wire, str) and wire.lower() in WIRE_DTYPES:
        return CastPolicy(WIRE_DTYPES[wire.lower()])
    if wire in (torch.bfloat16, torch.float16):
        return CastPolicy(wire)
    raise ConfigError(f"a low-precision reduction needs a 'bf16' or 'fp16' wire dtype, got {wire!r}")


def encode_low_precision(flat: torch.Tensor, rank: int, world: int, policy: CastPolicy) -> list[Optional[torch.Tensor]]:
    """Each other rank's chunk cast to the wire dtype; None for the own chunk (kept exact)."""
    return [None if dest == rank else chunk.to(policy.wire)
            for dest, chunk in enumerate(split_chunks(flat, world))]


def decode_low_precision(own_chunk: torch.Tensor, received: Sequence[Optional[torch.Tensor]],
                         policy: CastPolicy) -> torch.Tensor:
    total = torch.zeros(own_chunk.numel(), dtype=policy.accumulate, device=own_chunk.device)
    for message in received:
        total += (own_chunk if message is None else message).to(policy.accumulate)
    return total.to(policy.result)


def simulate_low_precision_reduce_scatter(inputs: Sequence[torch.Tensor],
                                          wire: Union[str, torch.dtype]) -> list[torch.Tensor]:
    """Each rank's reduced chunk: every value rounded to ``wire`` once, sums in fp32.

    >>> x = torch.full((2,), 1 + 2 ** -10)                # not a bf16 value: the sent copy rounds to 1
    >>> [s.tolist() for s in simulate_low_precision_reduce_scatter([x, x], "bf16")]
    [[2.0009765625], [2.0009765625]]
    """
    policy, world = cast_policy(wire), len(inputs)
    sent = [encode_low_precision(x, rank, world, policy) for rank, x in enumerate(inputs)]
    return [decode_low_precision(split_chunks(inputs[rank], world)[rank], received, policy)
            for rank, received in enumerate(all_to_all(sent))]


def low_precision_reduce_scatter_bytes(numel: int, world: int, wire: Union[str, torch.dtype]) -> int:
    """Bytes one rank sends: (N-1)/N of the buffer at the wire dtype's size.

    >>> low_precision_reduce_scatter_bytes(4096, world=4, wire="bf16")
    6144
    """
    _check_divisible(numel, world)
    itemsize = torch.empty((), dtype=cast_policy(wire).wire).element_size()
    return ring_bytes("reduce_scatter", numel * itemsize, world)
