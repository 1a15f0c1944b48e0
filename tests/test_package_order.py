"""Packages in dependency order: a package of `jaxpaged/` imports only the packages below it.

`LAYERS` is the order, lowest first, declared here once. A unit is a subpackage of `jaxpaged/`
or a module directly in it (`functional.py`, `engine_args.py`, ...); `jaxpaged` itself (its
`__init__`, which exports the public names) is the top. Every `import` and `from ... import` in
every module counts, those inside functions included: an import hidden in a function is still a
dependency. Read from the source (no module is imported), so this runs in milliseconds.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxpaged"
TOP = "jaxpaged"  # the root package's __init__

LAYERS = (
    "sampling_params",  # what a request asks for
    "lora_request",  # the LoRA adapter a request runs with
    "outputs",  # what it gets back
    "config",  # static facts: the model's configuration, its architecture and parameter tables, options, quantization
    "core",  # the host side: sequences, block manager, scheduler, detokenizer (no JAX)
    "structured",  # structured outputs: llguidance grammars, matchers, token masks (no JAX)
    "parallel",  # the sharding rules, the device mesh, several processes
    "model",  # the NNX model, its KV pool and metadata, the sampler
    "checkpoint",  # checkpoint files, the HF tensor map, loading and conversion
    "engine_args",  # every engine option; maps the components' errors to the option's name
    "engine_config",  # the resolved configuration handed to the planner, runner, scheduler and server
    "planning",  # KV cache sizing and `jaxpaged plan`
    "functional",  # the pure step function
    "worker",  # the device side: model runner, step programs, step packer
    "engine",  # LLMEngine and start-up
    "entrypoints",  # LLM, the engine flags every command shares, `generate`, `jaxpaged-convert`
    "server",  # the OpenAI-compatible server
    "bench",  # `jaxpaged bench`
    "cli",  # the `jaxpaged` command, which dispatches to all of the above
    TOP,
)
RANK = {unit: i for i, unit in enumerate(LAYERS)}


def unit_of(path: pathlib.Path) -> str:
    """The unit a module of `jaxpaged/` belongs to."""
    parts = path.relative_to(PACKAGE).parts
    if parts == ("__init__.py",):
        return TOP
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imported_modules(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, dotted name) of every jaxpaged module the code `source` of a module in `package`
    imports, at any depth of the code; `from jaxpaged.x import y` names `jaxpaged.x.y` (a module,
    or a name in `jaxpaged.x`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                base = ".".join(package[: len(package) - node.level + 1] + ((base,) if base else ()))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "jaxpaged"]


def imported_unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else TOP


def upward_imports() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        package = ("jaxpaged", *path.relative_to(PACKAGE).parent.parts)
        for line, name in imported_modules(path.read_text(), package):
            target = imported_unit(name)
            if target != unit and RANK[target] > RANK[unit]:
                problems.append(
                    f"{path.relative_to(ROOT)}:{line} imports {name}: {unit!r} may import only the "
                    f"packages below it in tests/test_package_order.py LAYERS, and {target!r} is above it"
                )
    return problems


def test_every_package_has_its_place_in_the_order():
    units = {unit_of(path) for path in PACKAGE.rglob("*.py")}
    assert not units - set(RANK), f"place these in LAYERS (tests/test_package_order.py): {sorted(units - set(RANK))}"
    assert not set(RANK) - units, f"LAYERS names what jaxpaged/ no longer has: {sorted(set(RANK) - units)}"


def test_no_package_imports_a_package_above_it():
    problems = upward_imports()
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_the_check_sees_imports_inside_functions_and_relative_ones():
    source = (
        "import os\nfrom jaxpaged import LLM\nimport jaxpaged.model.llama\n\n\ndef f():\n"
        "    from jaxpaged.server.cli import serve\n    from .. import outputs\n    from .scheduler import X\n"
    )
    found = imported_modules(source, ("jaxpaged", "core"))
    assert found == [
        (2, "jaxpaged.LLM"),
        (3, "jaxpaged.model.llama"),
        (7, "jaxpaged.server.cli.serve"),
        (8, "jaxpaged.outputs"),
        (9, "jaxpaged.core.scheduler.X"),
    ]
    assert [imported_unit(name) for _, name in found] == [TOP, "model", "server", "outputs", "core"]
