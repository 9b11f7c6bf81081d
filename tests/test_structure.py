"""Structural guards: the option vocabulary stays a torch-free leaf, options are declared once, and the
package's import graph has no cycle and keeps the engine out of its parts."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.options import Process, option_fields, options_for

ROOT = Path(__file__).resolve().parent.parent


def _import_graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("module", ["ssd.options", "ssd.config"])
def test_options_and_config_load_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_config_imports_only_the_option_vocabulary():
    graph = _import_graph_module().import_graph(ROOT, type_checking=True)
    assert graph["ssd.config"] == {"ssd.options"}
    assert graph["ssd.options"] == set()


def test_the_import_graph_has_no_cycle():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--cycles"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 cycle(s)" in result.stdout


def test_the_cycle_finder_finds_cycles():
    cycles = _import_graph_module().cycles
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}) == [["c", "d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_only_the_front_ends_import_the_engine():
    graph = _import_graph_module().import_graph(ROOT, type_checking=True)
    allowed = ("ssd.llm", "ssd.server.", "ssd.cli.")
    importers = _import_graph_module().importers_of(graph, "ssd.engine")
    assert [m for m in importers if not m.startswith(allowed)] == []


def test_the_engine_reads_proposers_only_through_their_interface():
    graph = _import_graph_module().import_graph(ROOT, type_checking=True)
    methods = ("ssd.speculative.async_draft", "ssd.speculative.draft_proposer", "ssd.speculative.ngram_proposer",
               "ssd.speculative.drafting")
    for module in ("ssd.engine", "ssd.step"):
        assert [m for m in graph[module] if m.startswith(methods)] == [], module


def test_every_field_is_a_declared_option_with_help():
    for config_class in (EngineConfig, SpeculativeConfig):
        declared = {f.name for f, info in option_fields(config_class) if info.help}
        fields = {f.name for f in dataclasses.fields(config_class)} - {"speculative_config"}
        assert declared == fields, config_class.__name__


def _attributes_read(path: Path, owner: str) -> set[str]:
    """Attribute names a module reads off a name or attribute called ``owner`` (``spec.x``, ``config.spec.x``)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            value = node.value
            if (isinstance(value, ast.Name) and value.id == owner) or (
                    isinstance(value, ast.Attribute) and value.attr == owner):
                names.add(node.attr)
    return names


def test_the_draft_worker_reads_only_options_declared_for_it():
    """The process column of the declarations is what the worker reads: a new option the worker starts to read
    must be declared for it (or this fails)."""
    worker = ROOT / "ssd" / "speculative" / "async_draft" / "worker.py"
    derived = {"lookup": {"prompt_lookup", "prompt_lookup_min", "prompt_lookup_max"},
               "fan_outs": {"fan_out", "fan_out_miss"},  # properties of SpeculativeConfig
               "spec": set()}  # EngineConfig's speculative options, checked as SpeculativeConfig's
    for config_class, owner in ((SpeculativeConfig, "spec"), (EngineConfig, "engine_config")):
        read = set()
        for name in _attributes_read(worker, owner):
            read |= derived.get(name, {name})
        declared = {f.name for f, info in option_fields(config_class) if Process.DRAFT_WORKER in info.processes}
        assert read and read <= declared, (config_class.__name__, sorted(read - declared))


def test_target_ranks_get_exactly_the_runner_arguments():
    from ssd.distributed.worker import RunnerArgs

    config = EngineConfig(model="m", max_num_seqs=3, kv_cache_memory="1MiB", fused_kernels=False)
    args = RunnerArgs.from_config(config)
    assert {f.name for f in dataclasses.fields(RunnerArgs)} == set(options_for(config, Process.TARGET_RANK))
    assert (args.max_num_seqs, args.kv_cache_memory, args.fused_kernels) == (3, 1 << 20, False)


def test_the_command_line_has_a_flag_for_every_option():
    import argparse

    from ssd.cli.common import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d", "--k", "3", "--fan-out", "2",
                                              "--block-size", "32", "--no-fused-kernels", "--full-builds"]))
    config = EngineConfig(**kwargs)
    assert (config.block_size, config.fused_kernels, config.spec.num_speculative_tokens) == (32, False, 3)
    assert str(config.spec.fan_out) == "2" and config.spec.interruptible_build is False
    defaults = EngineConfig(**engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d"])))
    library = EngineConfig(model="t", speculative_config={"method": "ssd", "model": "d"})
    assert defaults == library  # the flags' defaults are the library's (the command speculates with SSD)


MAX_MODULE_LINES = 400


def test_no_module_of_the_package_exceeds_400_lines():
    """A module that grows past this is doing more than one thing: split it by concern."""
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "ssd").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"
