"""The huge-page weight buffer (dist_runtime.arena): when it is taken, what it holds, and that a
run over it gives the same bits as over the weights as loaded."""

import numpy as np
import pytest

from dist_runtime import arena
from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.kernels.quant import quantize
from dist_runtime.tensor import QuantizedArray

from test_executor import TOKENS, with_specs

CFG = LlamaConfig(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
BIG = arena.MIN_BYTES


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]", "never"), ("garbage", None)])
def test_thp_mode_reads_the_bracketed_choice(tmp_path, text, mode):
    (tmp_path / "enabled").write_text(text)
    assert arena.thp_mode(tmp_path / "enabled") == mode


def test_thp_mode_of_a_missing_file_is_none(tmp_path):
    assert arena.thp_mode(tmp_path / "absent") is None


@pytest.mark.parametrize("nbytes, mode, wanted, packed, says", [
    (BIG, "madvise", None, True, "copied into one buffer of 2 MiB pages"),
    (BIG, "always", True, True, "transparent huge pages: always"),
    (BIG - 1, "madvise", None, False, "4 KiB pages fit the TLB"),
    (1, "madvise", True, True, "copied"),  # forced: size does not matter
    (BIG, "madvise", False, False, "huge_pages=False"),
    (BIG, "never", None, False, "transparent huge pages are 'never'"),
    (BIG, "never", True, False, "transparent huge pages are 'never'"),  # cannot be forced
    (BIG, None, None, False, "no transparent huge pages"),
])
def test_decide(nbytes, mode, wanted, packed, says):
    p = arena.decide(nbytes, mode, wanted)
    assert p.packed is packed and says in p.reason and "MiB of streamed weights" in p.reason


def _weights():
    w = llama_weights(CFG, seed=3)
    return {n: quantize(a, DType.Q8_0) if n.endswith("up_proj.weight") else a for n, a in w.items()}


def _packed(names, weights):
    if arena.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {arena.thp_mode()!r} here: nothing is packed")
    return arena.pack(weights, names, wanted=True)


def test_pack_copies_the_named_weights_read_only_and_leaves_the_others():
    w = _weights()
    names = [n for n in w if n.startswith("model.layers.")][::-1]
    out, p = _packed(names, w)
    assert p.packed and p.nbytes >= sum(w[n].nbytes for n in names) and 0 <= p.huge_bytes <= p.nbytes
    for n, a in w.items():
        got = out[n]
        if n not in names:
            assert got is a
            continue
        if isinstance(a, QuantizedArray):
            assert isinstance(got, QuantizedArray) and (got.dtype, got.shape) == (a.dtype, a.shape)
            got, a = got.data, a.data
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)
        assert not np.shares_memory(got, a) and not got.flags.writeable
        assert got.ctypes.data % 4096 == 0  # each weight on its own page
    starts = [(out[n].data if isinstance(out[n], QuantizedArray) else out[n]).ctypes.data for n in names]
    assert starts == sorted(starts)  # in the order given: the order the steps read them
    assert starts[0] % arena.HUGE_PAGE == 0


def test_a_large_pack_is_backed_by_huge_pages_where_the_system_has_them():
    w = {"a": np.ones((8, 2**20), np.float32)}  # 32 MiB: at least 14 whole 2 MiB pages
    out, p = _packed(["a"], w)  # skips where the system has no transparent huge pages
    assert 14 << 21 <= p.huge_bytes <= 32 << 20 and f"{p.huge_bytes >> 20} MiB of it in huge pages" in p.reason


def test_huge_pages_takes_only_true_false_or_none():
    w = _weights()
    with pytest.raises(TypeError, match="huge_pages= takes True, False or None"):
        GraphExecutor((with_specs(llama_graph(CFG), w), w), huge_pages="no")


def test_executor_over_the_packed_weights_gives_the_same_bits():
    w = _weights()
    g = with_specs(llama_graph(CFG), w)
    runs = {}
    for huge in (False, True):
        ex = GraphExecutor((g, w), huge_pages=huge)
        if huge and not ex.placement.packed:
            pytest.skip(ex.placement.reason)
        assert ex.placement.packed is huge
        runs[huge] = [ex.run({"tokens": TOKENS})["logits"], ex.run({"tokens": TOKENS[:1]})["logits"]]
    for a, b in zip(runs[False], runs[True]):
        assert np.array_equal(a, b)


def test_executor_packs_the_matrix_weights_not_norms_or_tables():
    w = _weights()
    ex = GraphExecutor((with_specs(llama_graph(CFG), w), w), huge_pages=True)
    if not ex.placement.packed:
        pytest.skip(ex.placement.reason)
    consts = ex._constants
    assert consts["model.norm.weight"] is w["model.norm.weight"]
    assert consts["model.layers.0.self_attn.q_proj.weight"] is not w["model.layers.0.self_attn.q_proj.weight"]


def test_a_small_model_stays_as_loaded_by_default():
    w = _weights()
    ex = GraphExecutor((with_specs(llama_graph(CFG), w), w))
    assert not ex.placement.packed and "as loaded" in ex.placement.reason


def test_release_gives_back_a_tensors_pages_and_its_views_still_read_the_file(tmp_path):
    from dist_runtime.examples import llama_metadata
    from dist_runtime.model import load_model, save_model
    from dist_runtime.pipeline.weights import resident_file_bytes

    big = LlamaConfig(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)
    path = tmp_path / "m.model"
    save_model(path, llama_graph(big), llama_weights(big, seed=1), llama_metadata(big)).close()
    with load_model(path) as m:
        name = "model.layers.0.mlp.up_proj.weight"  # 512 KiB
        view = m.tensor(name)
        before_sum = float(view.sum())  # touches every page
        resident = resident_file_bytes(path)
        freed = m.release([name])
        assert freed >= view.nbytes - 2 * 4096 and name not in m.weights
        if resident is not None:
            assert resident_file_bytes(path) <= resident - freed + 64 * 1024
        assert float(view.sum()) == before_sum  # read again from the file


def test_an_executor_opened_from_a_path_releases_the_copied_pages(tmp_path):
    from dist_runtime.examples import llama_metadata
    from dist_runtime.model import save_model

    path = tmp_path / "m.model"
    save_model(path, llama_graph(CFG), _weights(), llama_metadata(CFG)).close()
    mapped = GraphExecutor(path, huge_pages=False)
    ex = GraphExecutor(path, huge_pages=True)
    if not ex.placement.packed:
        pytest.skip(ex.placement.reason)
    assert np.array_equal(ex.run({"tokens": TOKENS})["logits"], mapped.run({"tokens": TOKENS})["logits"])
    del mapped


def test_pack_releases_each_source_as_soon_as_it_is_copied():
    """The source of a weight is released right after its copy, before the next is copied: the
    copy never holds every weight twice (a 3B model's load peaked at twice its file)."""
    if arena.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {arena.thp_mode()!r} here: nothing is packed")
    w = _weights()
    names = [n for n in w if n.startswith("model.layers.")]
    events, real = [], arena._copy_into
    copied = lambda a, space: (events.append("copy"), real(a, space))[1]  # noqa: E731
    try:
        arena._copy_into = copied
        arena.pack(w, names, wanted=True, release=lambda got: events.append(("release", *got)))
    finally:
        arena._copy_into = real
    assert events == [e for n in names for e in ("copy", ("release", n))]
    assert arena.pack(w, names, wanted=False, release=lambda got: events.append(got))[1].packed is False
    assert len(events) == 2 * len(names)  # nothing copied, nothing released


def test_an_executor_given_a_loaded_model_releases_the_copied_pages(tmp_path):
    from dist_runtime.examples import llama_metadata
    from dist_runtime.model import load_model, save_model

    path = tmp_path / "m.model"
    save_model(path, llama_graph(CFG), _weights(), llama_metadata(CFG)).close()
    with load_model(path) as m:
        ex = GraphExecutor(m, huge_pages=True)
        if not ex.placement.packed:
            pytest.skip(ex.placement.reason)
        packed = [n for n in m.graph.weights if "layers" in n and n.endswith("proj.weight")]
        assert packed and not any(n in m.weights for n in packed)  # released: dropped from the map's views
        again = GraphExecutor(m, huge_pages=False)  # the map still serves a second executor
        assert np.array_equal(ex.run({"tokens": TOKENS})["logits"], again.run({"tokens": TOKENS})["logits"])
