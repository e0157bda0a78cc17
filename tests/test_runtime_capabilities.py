"""Each runtime declares the optional protocols it implements (`capabilities`); callers read the
declaration instead of probing. These tests hold every declaration to the members the runtime has."""

from __future__ import annotations

import inspect

import pytest

from conftest import load_runtime
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import (OPTIONAL_PROTOCOLS, GrammarVocabulary, ModelIdentity, NextTokenHeads, NotOffered, Runtime,
                                    SavedState, SelectedRows, SeveralSequences, Sizing, TreeDecoding)


def protocol_members(protocol: type, *, inherited: bool, attributes: bool) -> set[str]:
    """The names an optional protocol declares: methods and properties, and with `attributes` its
    annotated data members (set per instance, so only an instance shows them)."""
    names: set[str] = set()
    for klass in protocol.__mro__ if inherited else (protocol,):
        if klass not in OPTIONAL_PROTOCOLS:
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        if attributes:
            names |= set(vars(klass).get("__annotations__", {}))
    return names


def offers(obj, name: str) -> bool:
    """Whether `obj` (a class or an instance) has the member, without running a descriptor."""
    member = inspect.getattr_static(obj, name, None)
    return member is not None and not isinstance(member, NotOffered)


def declaration_mismatches(obj) -> list[str]:
    """Where a runtime (class or instance) and its `capabilities` disagree: a declared protocol with a
    member missing, or an undeclared one with a member of its own present. Empty when they match."""
    attributes = not isinstance(obj, type)
    declared = obj.capabilities
    wrong = [f"{p!r} is not an optional protocol" for p in declared if p not in OPTIONAL_PROTOCOLS]
    for protocol in OPTIONAL_PROTOCOLS:
        if protocol in declared:
            missing = sorted(n for n in protocol_members(protocol, inherited=True, attributes=attributes)
                             if not offers(obj, n))
            if missing:
                wrong.append(f"declares {protocol.__name__} but lacks {missing}")
        else:
            present = sorted(n for n in protocol_members(protocol, inherited=False, attributes=attributes)
                             if offers(obj, n))
            if present:
                wrong.append(f"has {present} of {protocol.__name__} without declaring it")
    return wrong


def runtime_classes() -> list[type]:
    from edgespec.exporters.coreml_reference import TorchReferenceRuntime
    from edgespec.runtimes.coreml import CoreMLRuntime
    from edgespec.runtimes.llamacpp import LlamaCppMtpRuntime, LlamaCppMultiSeqRuntime, LlamaCppRuntime, LlamaCppSequence
    from edgespec.runtimes.mlx import MlxMultiSeqRuntime, MlxRuntime
    from edgespec.runtimes.onnx_layered import LayeredOnnxRuntime
    from edgespec.runtimes.onnxrt import OnnxRuntime

    return [LlamaCppRuntime, LlamaCppMtpRuntime, LlamaCppMultiSeqRuntime, LlamaCppSequence, OnnxRuntime, LayeredOnnxRuntime,
            CoreMLRuntime, TorchReferenceRuntime, MlxRuntime, MlxMultiSeqRuntime]


def test_the_protocols_name_their_members():
    assert protocol_members(TreeDecoding, inherited=True, attributes=True) == {"decode_tree", "keep_tree_path"}
    assert protocol_members(ModelIdentity, inherited=True, attributes=True) == {"path", "compatibility_key"}
    assert protocol_members(SavedState, inherited=False, attributes=True) == {"save_state", "load_state"}
    assert protocol_members(SavedState, inherited=True, attributes=True) == {
        "save_state", "load_state", "path", "compatibility_key"}
    assert {"n_seq", "decode_batch", "sequence", "seq_truncate"} <= protocol_members(
        SeveralSequences, inherited=True, attributes=True)
    assert protocol_members(NextTokenHeads, inherited=True, attributes=True) == {
        "n_next_token_heads", "hidden_rows", "next_token_head"}


@pytest.mark.parametrize("cls", runtime_classes(), ids=lambda c: c.__name__)
def test_every_runtime_class_declares_what_it_has(cls):
    assert isinstance(cls.capabilities, frozenset)
    assert declaration_mismatches(cls) == []


def test_llama_cpp_runtimes_declare_what_they_have(tiny_pair):
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    single = load_runtime(tiny_pair["target"], n_seq_max=3, n_outputs_max=9, n_threads=1)
    multi = LlamaCppMultiSeqRuntime(tiny_pair["target"], LlamaCppOptions(n_ctx=512, n_threads=1, n_outputs_max=8),
                                    n_seq=2)
    try:
        seq = multi.sequence(1, 256)
        for rt in (single, multi, seq):
            assert declaration_mismatches(rt) == [], type(rt).__name__
        assert isinstance(single, Runtime) and isinstance(seq, Runtime)
        assert single.capabilities == {TreeDecoding, ModelIdentity, SavedState, GrammarVocabulary, SelectedRows}
        assert multi.capabilities == {SeveralSequences, ModelIdentity, GrammarVocabulary}
        assert seq.capabilities == {ModelIdentity, SavedState, GrammarVocabulary}
        # the sizing facts are the options the runtime was made with; a slot gets its share of rows
        assert single.sizing == Sizing(n_batch=single.n_batch, n_threads=1, n_outputs_max=9, n_seq_max=3)
        assert seq.sizing == Sizing(n_batch=multi.n_batch, n_threads=1, n_outputs_max=4, n_seq_max=1)
        with pytest.raises(TypeError, match="several sequences"):
            multi.decode_tree([1, 2], [-1, 0])  # trees would clobber the other sessions
    finally:
        single.close()
        multi.close()


def test_selected_rows_are_the_rows_decode_gives(tiny_pair):
    """decode_rows computes only the rows asked for, and they are decode's rows, bit for bit."""
    import numpy as np

    rt = load_runtime(tiny_pair["target"], n_threads=1)
    try:
        prompt, tokens = [295, 104, 101], [108, 108, 111, 32, 104]
        rt.decode(prompt, 0)
        every = rt.decode(tokens, len(tokens))
        rt.truncate(len(prompt))
        some = rt.decode_rows(tokens, [0, 2, 4])
        assert rt.n_past == len(prompt) + len(tokens) and rt.tokens.tolist() == prompt + tokens
        assert np.array_equal(some, every[[0, 2, 4]])
        rt.truncate(len(prompt))
        assert rt.decode_rows(tokens, []).shape == (0, rt.vocab.n_vocab) and rt.n_past == len(prompt) + len(tokens)
        with pytest.raises(ValueError, match="increasing"):
            rt.decode_rows([1, 2], [1, 0])
    finally:
        rt.close()


def test_saved_state_is_refused_for_a_runtime_that_does_not_declare_it(tiny_pair, tmp_path):
    from edgespec.persist import load_state, save_state
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    multi = LlamaCppMultiSeqRuntime(tiny_pair["target"], LlamaCppOptions(n_ctx=256, n_threads=1), n_seq=2)
    try:
        with pytest.raises(EdgespecError, match="cannot save or restore"):
            save_state(tmp_path / "s.state", {"target": multi})
        with pytest.raises(EdgespecError, match="cannot save or restore"):
            load_state(tmp_path / "s.state", {"target": multi})
        assert not (tmp_path / "s.state").exists()
    finally:
        multi.close()


def test_every_policy_has_the_rows_of_other_slots():
    from edgespec.policy import FixedPolicy

    assert FixedPolicy(None, 0).rows_besides == 0  # the slot scheduler sets it on every policy; auto weighs it
