"""Plain-text reports: the per-plan table, the device catalog."""
from __future__ import annotations

from ..api import Estimate
from ..plan.capacity import conditions, shortfalls
from ..hardware.devices import CATALOG
from ..byte_units import GB, format_bytes

TERMS = ("params", "grads", "optimizer_states", "activations", "working_set", "overhead", "total")
_VERDICT_CELL = {"fits": "yes", "tight": "tight", "fits if": "if node", "does not fit": "no"}


def _table_unit(result: Estimate) -> tuple[str, int]:
    """GiB, unless every total is under one: then MiB, so small models don't print as 0.00."""
    largest = max(plan.total for plan in result.plans)
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def _param_count(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f} {suffix}"
    return str(count)


def _header(result: Estimate) -> list[str]:
    setup = result.setup
    return [
        f"model: {result.params:,} params ({_param_count(result.params)}, {result.stats.source})   "
        f"device: {result.device.name}, {format_bytes(result.device.memory_bytes)} "
        f"(usable {format_bytes(result.device.memory_bytes * (1 - setup.safety_margin))} "
        f"after {setup.safety_margin:.0%} margin)",
        f"setup: {result.engine}, {result.world_size} rank(s), {setup.policy.name}, {setup.optimizer} "
        f"({setup.optimizer_impl}), micro-batch {setup.micro_batch}, seq {setup.seq_len}, checkpointing "
        f"{setup.checkpointing}, fused attention {'on' if setup.fused_attention else 'off'}; "
        f"activations: {result.activation_source}",
        *([result.shares.header()] if result.shares is not None else []),
        f"node: {result.capacity.text(result.world_size)}",
        "",
    ]


def _rows(result: Estimate, amount) -> list[list[str]]:
    rows = [[term] + [amount(plan.total if term == "total" else getattr(plan, term)) for plan in result.plans]
            for term in TERMS]
    rows.append(["headroom"] + [amount(plan.headroom) for plan in result.plans])
    rows.append(["peak at"] + [plan.peak_moment for plan in result.plans])
    rows.append(["fits"] + [_VERDICT_CELL[plan.verdict] for plan in result.plans])
    return rows


def format_table(result: Estimate) -> str:
    """Plain-text report: one column per plan, one row per term, in GiB (MiB for small models)."""
    unit, scale = _table_unit(result)
    amount = lambda num_bytes: f"{num_bytes / scale:.2f}"  # noqa: E731
    header = [f"per rank ({unit})"] + [plan.name for plan in result.plans]
    rows = _rows(result, amount)
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    render = lambda row: "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)  # noqa: E731
                                   for i, (cell, w) in enumerate(zip(row, widths)))
    rule = "  ".join("-" * w for w in widths)
    lines = _header(result) + [render(header), rule] + [render(r) for r in rows[:-4]] + [rule]
    lines += [render(r) for r in rows[-4:]] + [""]
    for plan in result.plans:
        if plan.host_bytes:
            kinds = [(kind, getattr(plan, f"host_{kind.replace(' ', '_')}"))
                     for kind in ("params", "grads", "optimizer states")]
            # DeepSpeed's host buffers: the fp32 gradient partitions and the NVMe tier's swap buffers
            kinds.append(("fp32 gradients and swap buffers", plan.host_bytes - sum(size for _, size in kinds)))
            held = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in kinds if size)
            lines.append(f"{plan.name}: host RAM {format_bytes(plan.host_bytes)} per rank ({held}); "
                         + _per_node(plan.host_bytes_per_node, plan.host_capacity, plan.host_verdict, result))
        if plan.disk_bytes:
            rest = "optimizer states" + (" and fp32 gradients" if result.engine == "deepspeed" else "")
            kinds = [("params", plan.disk_params), (rest, plan.disk_bytes - plan.disk_params)]
            held = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in kinds if size)
            lines.append(f"{plan.name}: files on disk {format_bytes(plan.disk_bytes)} per rank ({held}); "
                         + _per_node(plan.disk_bytes_per_node, plan.disk_capacity, plan.disk_verdict, result))
    loading = [f"{plan.name} {format_bytes(plan.load_host_peak)}" for plan in result.plans if plan.load_host_peak]
    if loading:
        lines.append("host RAM per rank while the base loads (stage 3 streams it in; the others load it whole): "
                     + ", ".join(loading))
    lines += _recommendation(result)
    lines += [f"warning: {note}" if note in result.warnings else f"note: {note}" for note in result.notes]
    lines += format_confidence(result)
    lines += format_drivers(result)
    return "\n".join(lines)


def _per_node(need: int, capacity, verdict: str, result: Estimate) -> str:
    ranks = result.capacity.ranks_per_node(result.world_size)
    text = f"{format_bytes(need)} per node ({ranks} rank{'s' if ranks > 1 else ''})"
    if verdict == "unknown":
        return text + ", capacity not stated"
    return text + f" of {format_bytes(capacity)}: " + ("fits" if verdict == "fits" else "does not fit")


def _recommendation(result: Estimate) -> list[str]:
    """The recommended line: the plan, or why none fits (the device, the host, the disk)."""
    plan = result.recommended_plan
    if plan is not None:
        line = (f"recommended: {plan.name}   largest micro-batch that fits it: "
                f"{result.max_micro_batch if result.max_micro_batch is not None else 'unknown'}")
        if plan.verdict == "fits if":
            line += "\n  not a plain fit: it fits if " + " and ".join(conditions(plan))
        return [line]
    tight = [plan.name for plan in result.plans if plan.verdict == "tight"]
    lines = ["recommended: none fits" + (f" with the margin ({', '.join(tight)} within it: may fit)" if tight else "")]
    for plan in result.plans:
        short = shortfalls(plan)
        if plan.device_verdict == "fits" and short:
            lines.append(f"  {plan.name} fits the device but not the node: {'; '.join(short)}")
    return lines + [f"  would fit: {advice}" for advice in result.suggestions]


def format_confidence(result: Estimate) -> list[str]:
    """How sure the answer is: for the recommended plan and every ``tight`` one, what its terms rest
    on, the range its total holds over, and what the verdict turns on or is unbounded by."""
    from ..plan.confidence import unless_text

    shown = [plan for plan in result.plans if plan.name == result.recommended or plan.verdict == "tight"]
    lines = []
    for plan in shown[:4]:
        confidence = plan.confidence
        if confidence is None or result.device.kind == "cpu":
            continue
        bases = {}
        for term in confidence.terms:
            if term.bytes or term.high:
                bases.setdefault(term.basis, []).append(term.term)
        rests = "; ".join(f"{basis} {', '.join(names)}" for basis, names in bases.items())
        lines.append(f"how sure ({plan.name}): {rests}; holds over {confidence.holds_over()}; "
                     f"{unless_text(confidence, plan.device_verdict)}")
    return lines


def format_drivers(result: Estimate) -> list[str]:
    """What drove each plan's number: the costliest assumptions and the flag that changes each."""
    if not any(result.drivers.values()):
        return []
    lines = ["what drove the numbers (assumption, what it costs, the flag that changes it):"]
    for plan in result.plans:
        for driver in result.drivers.get(plan.name, ()):
            lines.append(f"  {plan.name}: {driver.text()}")
    return lines


def format_breakdown(result: Estimate) -> str:
    """The named buffers behind each plan's working set and overhead."""
    unit, scale = _table_unit(result)
    lines = [f"buffers at each plan's peak ({unit}):"]
    for plan in result.plans:
        parts = ", ".join(f"{name} {size / scale:.2f}" for name, size in plan.buffers.items())
        lines.append(f"  {plan.name} ({plan.peak_moment}): {parts or 'none'}")
    return "\n".join(lines)


def format_devices() -> str:
    width = max(len(name) for name in CATALOG)
    lines = [f"{'device'.ljust(width)}  {'bytes':>16}  {'GiB':>7}  {'GB':>7}  source"]
    for device in CATALOG.values():
        source = "reported total capacity" if device.reported else "nominal minus reserve"
        lines.append(f"{device.name.ljust(width)}  {device.memory_bytes:>16,}  "
                     f"{device.memory_bytes / 2**30:>7.2f}  {device.memory_bytes / GB:>7.2f}  {source}")
    return "\n".join(lines)
