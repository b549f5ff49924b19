import sys
import textwrap

import pytest

import harness.registry as registry
from harness.spec.contract import Implementation, package
from harness.spec.shapes import SHAPE_SETS, SWEEP_ELEMENTS, parse_shape


def test_eager_and_compile_are_registered_for_every_op():
    from harness.spec.ops import FP8_OPS, OPS

    reg = registry.all_implementations()
    for name in ("eager", "compile", "compile-max-autotune"):
        # the FP8 ops compile in the default mode only (impls/compile/__init__.py)
        assert set(reg[name].ops) == set(OPS) - (set(FP8_OPS) if name == "compile-max-autotune" else set())
        assert reg[name].available("cpu"), reg[name].unavailable("cpu")
    assert reg["quack"].external and reg["liger"].external


def test_a_new_folder_registers_itself(tmp_path, monkeypatch):
    import impls

    pkg = tmp_path / "impls_extra" / "myimpl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from harness.spec.contract import Implementation
            IMPLEMENTATIONS = [Implementation(name="my-new-impl", dsl="triton", entry="impls.eager.kernels", devices=("cpu",))]
            """
        )
    )
    monkeypatch.setattr(impls, "__path__", [*impls.__path__, str(tmp_path / "impls_extra")])
    monkeypatch.setattr(registry, "_REGISTRY", None)
    try:
        assert "my-new-impl" in registry.all_implementations()
        assert registry.get("my-new-impl").available("cpu")
    finally:
        registry._REGISTRY = None
        sys.modules.pop("impls.myimpl", None)


def test_select_globs_by_name_and_dsl():
    assert {i.name for i in registry.select("compile*")} == {"compile", "compile-max-autotune"}
    assert all(i.dsl == "external" for i in registry.select("external"))
    with pytest.raises(ValueError, match="no implementation matches"):
        registry.select("zzz*")


def test_missing_package_is_a_reason_not_an_error():
    impl = Implementation(name="x", dsl="triton", entry="nowhere", devices=("cpu",), requires=(package("no_such_pkg_123"),))
    assert "no_such_pkg_123" in impl.unavailable("cpu")
    with pytest.raises(ValueError, match="no_such_pkg_123"):
        impl.kernels("cpu")


def test_shape_sets_are_the_design_card():
    assert {s.m for s in SHAPE_SETS["smoke"]} == {1, 3, 128}
    assert {s.n for s in SHAPE_SETS["smoke"]} == {1, 7, 64, 1000, 4096}
    assert all(s.m * s.n <= SWEEP_ELEMENTS and s.m * s.n > SWEEP_ELEMENTS * 0.99 for s in SHAPE_SETS["sweep"])
    assert [s.n for s in SHAPE_SETS["sweep"]][-1] == 262144
    edge = SHAPE_SETS["edge"]
    assert any(s.layout == "column-slice" for s in edge) and any(len(s.dims) == 3 for s in edge)
    assert any(s.m == 0 for s in edge) and any(s.n % 8 for s in edge) and any(s.n == 2880 for s in edge)
    assert {(s.m, s.n) for s in SHAPE_SETS["decode"]} == {(m, n) for m in (1, 16, 128) for n in (4096, 8192)}
    # between: the sweep's bytes per point at N the sweep lacks, an odd one among them, spanning it
    between, sweep_n = SHAPE_SETS["between"], {s.n for s in SHAPE_SETS["sweep"]}
    assert all(s.m * s.n <= SWEEP_ELEMENTS and s.m * s.n > SWEEP_ELEMENTS * 0.99 for s in between)
    assert not {s.n for s in between} & sweep_n and any(s.n % 2 for s in between)
    assert min(s.n for s in between) < 2048 and max(s.n for s in between) > 65536
    assert parse_shape("4x8x16:column-slice").dims == (4, 8, 16)
    with pytest.raises(ValueError):
        parse_shape("4xq")
