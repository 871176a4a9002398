"""Composition by functions: the composed strategy is parallelized by plain functions and measured by
probes it holds, never by inheriting from a probe or a measured strategy. Checked on the loaded classes
(their method resolution order), so that a mixin added anywhere up the chain is caught."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from shardlab.strategies.base import CommTimer, Strategy

# Where measurement lives: the pipeline probe, the registered pipeline strategies (each holds a probe), the
# loop's probes.
MEASUREMENT_MODULES = ("shardlab.strategies.pipeline_parallel.probe", "shardlab.strategies.pipeline_parallel.strategy",
                       "shardlab.runner.probes")


def _classes_defined_in(module_name: str) -> list[type]:
    module = importlib.import_module(module_name)
    return [cls for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == module_name]


def _package_classes(package_name: str) -> list[type]:
    package = importlib.import_module(package_name)
    names = [package_name] + [f"{package_name}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return [cls for name in names for cls in _classes_defined_in(name)]


def measurement_classes() -> set[type]:
    return {CommTimer} | {cls for name in MEASUREMENT_MODULES for cls in _classes_defined_in(name)}


def inheriting_measurement(classes) -> dict[str, list[str]]:
    """Each class that has a measurement class among its bases, anywhere in its MRO, with those bases."""
    measuring = measurement_classes()
    found = {}
    for cls in classes:
        bases = [base.__qualname__ for base in inspect.getmro(cls)[1:] if base in measuring]
        if bases:
            found[f"{cls.__module__}.{cls.__qualname__}"] = bases
    return found


def test_no_composed_class_inherits_from_a_probe_or_a_measured_strategy():
    classes = _package_classes("shardlab.strategies.composed")
    assert any(issubclass(cls, Strategy) for cls in classes), "the composed strategy class was not found"
    assert inheriting_measurement(classes) == {}


def test_pipeline_strategies_hold_their_probe_rather_than_inherit_it():
    from shardlab.strategies.pipeline_parallel.probe import PipelineProbe

    classes = _package_classes("shardlab.strategies.pipeline_parallel")
    assert [cls for cls in classes if PipelineProbe in inspect.getmro(cls)[1:]] == []


def test_the_check_catches_a_probe_mixed_in_anywhere_up_the_chain():
    """The check can fail: a strategy with the pipeline probe as a base, or one step removed."""
    from shardlab.strategies.composed.strategy import ComposedStrategy
    from shardlab.strategies.pipeline_parallel.strategy import GPipeStrategy
    from shardlab.strategies.pipeline_parallel.probe import PipelineProbe

    mixed = type("Mixed", (ComposedStrategy, PipelineProbe), {})
    below = type("Below", (mixed,), {})
    measured = type("OnAMeasuredPipeline", (GPipeStrategy,), {})
    found = inheriting_measurement([mixed, below, measured, ComposedStrategy])
    assert set(found) == {f"{__name__}.Mixed", f"{__name__}.Below", f"{__name__}.OnAMeasuredPipeline"}
    assert found[f"{__name__}.Below"] == ["PipelineProbe"]
