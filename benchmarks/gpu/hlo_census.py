"""What a compiled program's HLO does with its weights: plain text in, counts out (no JAX here).

`census(hlo_text, weight_sizes)` reads the text of `jax.stages.Compiled.as_text()` (XLA's HLO
after optimisation) and reports

- `custom_calls`: every custom-call target with its count (on a GPU: `__cublas$gemm`,
  `__cublas$lt$matmul`, `__cublas$lt$matmul$f8` for cuBLASLt's fp8 GEMMs,
  `__gpu$xla.gpu.triton` for the Pallas kernels, ...);
- `fusions`: every fusion kind with its count, a custom fusion as `kCustom:<backend kind>`
  (`__triton_gemm`, `__triton_nested_gemm_fusion`, `__cudnn$fusion`, `__custom_fusion`, ...);
- `gemms`: each GEMM by signature (`custom-call <target>` or `fusion <kind>`, operand and result
  types), counted; a GEMM fusion's signature also names the dtypes its `dot` multiplies;
- `dots`: each `dot` by operand and result dtypes and where it sits (`gemm fusion`, `fusion
  kLoop`, `top level`, ...): on a GPU every projection's dot should sit in a GEMM, and an fp8
  dot that reads float8 operands directly is an fp8 GEMM;
- `weight_sized`: the buffers of a weight's size (element count in `weight_sizes`) that the
  program writes to memory, i.e. made by an instruction outside any fusion (the fusion, copy or
  custom call itself) from an operand of a weight's size (an activation of a weight's size by
  chance, e.g. RoPE's halves of 2048 tokens' queries, is left out), classified: `upcasts` (a convert from an 8-bit type inside: the weight
  dequantised in memory, which the fp8 and int8 paths must not do), `relayouts_8bit` (a
  transpose or copy giving an 8-bit weight-sized result: the operand re-laid out for the GEMM),
  `slice_copies` (a dynamic-slice or slice: a layer's weight copied out of the stacked array in
  the scan over layers) as `materialized` signatures; and `inside_fusions`: weight-sized ops
  inside GEMM fusions and custom fusions, which read the weight where it lies (a convert in a
  GEMM fusion is the good case for int8: the weight is read as int8 and widened in registers; a
  dynamic-slice in XLA's dynamic-slice fusion hands cuBLAS the layer's weight without a copy).

HLO instruction lines look like
    %fusion.3 = bf16[16,4096]{1,0} fusion(bf16[16,4096]{1,0} %p, s8[4096,4096]{1,0} %w), kind=kCustom,
        calls=%gemm_fusion_dot.3_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm",...}}
The parser is tolerant of the operand types being printed or not, and of a missing `%`.
"""

import collections
import dataclasses
import re

# Instructions that make no buffer of their own (or only forward one).
PASS_THROUGH = frozenset(
    {
        "parameter",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "call",
        "conditional",
        "constant",
        "after-all",
        "opt-barrier",
        "add-dependency",
        "domain",
        "iota",
        "partition-id",
        "replica-id",
    }
)
# 8 bits or fewer: fp8, int8 and the 4-bit codes of group-quantized weights.
EIGHT_BIT = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "s8", "u8", "s4", "u4")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-$]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-$]+)")
_CALLED_LIST = re.compile(r"\b(?:calls|branch_computations|called_computations)=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_BACKEND_KIND = re.compile(r'"fusion_backend_config":\{[^{}]*?"kind":"([^"]+)"|"kind":"(__[^"]+)"')
_CUSTOM_FUSION_NAME = re.compile(r'"custom_fusion_config":\{"name":"([^"]+)"')


@dataclasses.dataclass
class Instr:
    name: str
    computation: str
    type_text: str  # e.g. "bf16[16,4096]{1,0}" or a tuple "(f32[..], s8[..])"
    opcode: str
    operands: list[str]
    attrs: str

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(element type, dims) of the result (each element of a tuple)."""
        return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(self.type_text)]

    def first_type(self) -> str:
        arrays = self.arrays()
        return "?" if not arrays else f"{arrays[0][0]}[{','.join(map(str, arrays[0][1]))}]"


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `text[start]` (( or {)."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


def parse(hlo_text: str) -> tuple[dict[str, Instr], dict[str, list[str]], str | None]:
    """`(instructions by name, instruction names by computation, the entry computation)`."""
    instrs, computations, current, entry = {}, {}, None, None
    for line in hlo_text.splitlines():
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        if not line[0].isspace():
            header = _HEADER.match(line)
            if header:
                current = header.group(2)
                computations[current] = []
                entry = current if header.group(1) else entry
            elif line.startswith("}"):
                current = None
            continue
        match = _INSTR.match(line) if current else None
        if not match:
            continue
        name, rest = match.group(2), match.group(3)
        if rest.startswith("("):  # a tuple type
            end = _balanced(rest, 0)
            type_text, rest = rest[:end], rest[end:].lstrip()
        else:
            type_text, _, rest = rest.partition(" ")
        opcode = _OPCODE.match(rest)
        if not opcode:
            continue
        open_at = opcode.end() - 1
        close = _balanced(rest, open_at)
        operands = [p.split()[-1].lstrip("%") for p in _split_top(rest[open_at + 1 : close - 1])]
        instrs[name] = Instr(name, current, type_text, opcode.group(1), operands, rest[close:])
        computations[current].append(name)
    return instrs, computations, entry


def _called(instr: Instr) -> list[str]:
    names = _CALLED.findall(instr.attrs)
    for group in _CALLED_LIST.findall(instr.attrs):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _fusion_label(instr: Instr) -> str:
    kind = _FUSION_KIND.search(instr.attrs)
    label = kind.group(1) if kind else "k?"
    backend = _BACKEND_KIND.search(instr.attrs)
    if backend:
        label += ":" + (backend.group(1) or backend.group(2))
        custom = _CUSTOM_FUSION_NAME.search(instr.attrs)
        if custom:
            label += ":" + custom.group(1)
    return label


def is_gemm_fusion(label: str) -> bool:
    """A fusion XLA emits as one GEMM (Triton's or cuDNN's), converts of its operands included."""
    backend = label.partition(":")[2].lower()
    return any(word in backend for word in ("gemm", "cudnn", "dot", "matmul"))


def _is_upcast(i: Instr, type_of, reads_weight) -> bool:
    """A convert from an 8-bit weight to a wider type."""
    return (
        i.opcode == "convert"
        and bool(i.operands)
        and type_of(i.operands[0]).startswith(EIGHT_BIT)
        and not i.first_type().startswith(EIGHT_BIT)
    )


def _is_relayout(i: Instr, type_of, reads_weight) -> bool:
    """A transpose or copy of an 8-bit weight."""
    return i.opcode in ("transpose", "copy") and i.first_type().startswith(EIGHT_BIT) and reads_weight(i)


def _is_slice_copy(i: Instr, type_of, reads_weight) -> bool:
    """A (dynamic) slice taken out of a weight-sized array (the stacked layers' weight)."""
    return i.opcode in ("dynamic-slice", "slice") and reads_weight(i)


CATEGORIES = {"upcasts": _is_upcast, "relayouts_8bit": _is_relayout, "slice_copies": _is_slice_copy}


def _size(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def census(hlo_text: str, weight_sizes: set[int] | frozenset[int]) -> dict:
    """Counts of custom calls, fusions, GEMMs, dots and weight-sized buffers (see the module)."""
    instrs, computations, entry = parse(hlo_text)
    # Who calls each computation: a fusion's body is "inside" it; while bodies etc. are top level.
    callers: dict[str, Instr] = {}
    for instr in instrs.values():
        for callee in _called(instr):
            callers.setdefault(callee, instr)

    def enclosing_fusions(computation: str) -> list[str]:
        labels, seen = [], set()
        while computation in callers and computation not in seen:
            seen.add(computation)
            caller = callers[computation]
            if caller.opcode == "fusion":
                labels.append(_fusion_label(caller))
            computation = caller.computation
        return labels

    context = {name: enclosing_fusions(name) for name in computations}

    def where(instr: Instr) -> str:
        labels = context.get(instr.computation, [])
        if any(is_gemm_fusion(label) for label in labels):
            return "gemm fusion"
        return f"fusion {labels[-1]}" if labels else "top level"

    def location(computation: str) -> str:
        if computation == entry:
            return "entry"
        caller = callers.get(computation)
        return f"{caller.opcode} body" if caller is not None else computation

    def type_of(name: str) -> str:
        return instrs[name].first_type() if name in instrs else "?"

    def weight_sized(instr: Instr) -> bool:
        arrays = instr.arrays()
        if instr.opcode == "custom-call":  # (result, s8[workspace]): a 4 MiB workspace is a k_proj's size
            arrays = arrays[:1]
        return any(_size(dims) in weight_sizes for _, dims in arrays if dims)

    def reads_weight(instr: Instr) -> bool:
        """Whether an operand has a weight's size (a weight, or a layer's slice of the stacked one)."""
        return any(name in instrs and weight_sized(instrs[name]) for name in instr.operands)

    def inner(instr: Instr) -> list[Instr]:
        """Every instruction of the computations a fusion calls, recursively."""
        out, todo, seen = [], list(_called(instr)), set()
        while todo:
            comp = todo.pop()
            if comp in seen or comp not in computations:
                continue
            seen.add(comp)
            for name in computations[comp]:
                out.append(instrs[name])
                todo += _called(instrs[name])
        return out

    custom_calls, fusions, gemms, dots = (collections.Counter() for _ in range(4))
    materialized, inside = collections.Counter(), collections.Counter()
    kinds = collections.Counter()  # materialized buffers per category
    for instr in instrs.values():
        top = not context.get(instr.computation)
        if instr.opcode == "custom-call":
            target = _TARGET.search(instr.attrs)
            target = target.group(1) if target else "?"
            custom_calls[target] += 1
            if any(w in target.lower() for w in ("gemm", "matmul")):
                ops = " x ".join(type_of(o) for o in instr.operands[:2])
                gemms[f"custom-call {target}: {ops} -> {instr.first_type()}"] += 1
        elif instr.opcode == "fusion" and top:
            label = _fusion_label(instr)
            fusions[label] += 1
            if is_gemm_fusion(label):
                its_dots = [i for i in inner(instr) if i.opcode in ("dot", "scaled-dot")]
                dot_types = ", ".join(
                    sorted({" x ".join(type_of(o).split("[")[0] for o in d.operands[:2]) for d in its_dots})
                )
                ops = " x ".join(type_of(o) for o in instr.operands[:2])
                gemms[f"fusion {label}: {ops} -> {instr.first_type()} (dot {dot_types or '?'})"] += 1
        if instr.opcode in ("dot", "scaled-dot"):
            ops = " x ".join(type_of(o).split("[")[0] for o in instr.operands[:2])
            dots[f"{ops} -> {instr.first_type().split('[')[0]} in {where(instr)}"] += 1
        if not weight_sized(instr):
            continue
        if top and instr.opcode not in PASS_THROUGH:
            ops = [instr, *inner(instr)] if instr.opcode == "fusion" else [instr]
            sized = [i for i in ops if weight_sized(i) and i.opcode not in PASS_THROUGH | {"fusion"}]
            hits = {kind for kind, test in CATEGORIES.items() if any(test(i, type_of, reads_weight) for i in sized)}
            if not hits and not reads_weight(instr):  # weight-sized by chance (an activation): not a weight
                continue
            kinds.update(hits)
            opcodes = sorted({i.opcode for i in sized}) or [instr.opcode]
            label = _fusion_label(instr) if instr.opcode == "fusion" else instr.opcode
            operand_types = ", ".join(type_of(o) for o in instr.operands[:3])
            materialized[
                f"{label} [{' '.join(opcodes)}]: ({operand_types}) -> {instr.first_type()} in "
                f"{location(instr.computation)}"
            ] += 1
        elif not top and instr.opcode not in PASS_THROUGH | {"fusion"} and reads_weight(instr):
            place = where(instr)
            if place == "gemm fusion" or place.startswith("fusion kCustom"):  # read in place, not written
                inside[
                    f"{instr.opcode} in {place}: ({', '.join(type_of(o) for o in instr.operands[:1])}) -> "
                    f"{instr.first_type()}"
                ] += 1
    fp8_custom = sum(n for t, n in custom_calls.items() if "f8" in t.lower())
    fp8_dots_in_gemms = sum(
        n for sig, n in dots.items() if sig.startswith("f8") and " x f8" in sig and sig.endswith("in gemm fusion")
    )
    return {
        "num_instructions": len(instrs),
        "num_computations": len(computations),
        "custom_calls": dict(custom_calls.most_common()),
        "fusions": dict(fusions.most_common()),
        "gemms": dict(gemms.most_common()),
        "dots": dict(dots.most_common()),
        "weight_sized": {
            "upcasts": kinds["upcasts"],
            "relayouts_8bit": kinds["relayouts_8bit"],
            "slice_copies": kinds["slice_copies"],
            "materialized": dict(materialized.most_common()),
            "inside_fusions": dict(inside.most_common()),
            "converts_in_gemm_fusions": sum(n for sig, n in inside.items() if sig.startswith("convert in gemm")),
        },
        "fp8_gemm_custom_calls": fp8_custom,
        "fp8_dots_in_gemm_fusions": fp8_dots_in_gemms,
        "gemm_custom_calls": sum(n for t, n in custom_calls.items() if any(w in t.lower() for w in ("gemm", "matmul"))),
        "gemm_fusions": sum(n for label, n in fusions.items() if is_gemm_fusion(label)),
    }
