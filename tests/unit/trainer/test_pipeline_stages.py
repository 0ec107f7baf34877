"""Pipeline stages' share of the whole model's weights and their names (`megatron/pipeline.py`):
each stage holds its run of layers under its own numbering, the first the embedding, the last
the final norm and the output layer, or its own copy of a tied embedding, saved once."""

from __future__ import annotations

from omniloop.trainer.megatron.pipeline import EMBEDDING, OUTPUT, Stages

WHOLE = {
    EMBEDDING: "E",
    "decoder.layers.0.mlp.linear_fc1.weight": "L0",
    "decoder.layers.1.mlp.linear_fc1.weight": "L1",
    "decoder.layers.2.mlp.linear_fc1.weight": "L2",
    "decoder.layers.3.mlp.linear_fc1.weight": "L3",
    "decoder.final_layernorm.weight": "N",
}


def test_each_stage_holds_its_layers_and_ends_under_its_own_names() -> None:
    first, last = (Stages(2, i, 2, tied=True) for i in range(2))
    assert first.local_weights(WHOLE) == {
        EMBEDDING: "E",
        "decoder.layers.0.mlp.linear_fc1.weight": "L0",
        "decoder.layers.1.mlp.linear_fc1.weight": "L1",
    }
    assert last.local_weights(WHOLE) == {
        "decoder.layers.0.mlp.linear_fc1.weight": "L2",
        "decoder.layers.1.mlp.linear_fc1.weight": "L3",
        "decoder.final_layernorm.weight": "N",
        OUTPUT: "E",  # its copy of the tied embedding
    }
    assert [first.holds(EMBEDDING), last.holds(EMBEDDING)] == [True, True]
    assert [first.holds("decoder.final_layernorm.weight"), last.holds(OUTPUT)] == [False, True]
    assert (first.layer_range, last.layer_range) == (range(0, 2), range(2, 4))


def test_names_map_back_to_the_whole_model_and_the_copy_is_saved_once() -> None:
    last = Stages(2, 1, 2, tied=True)
    for name in last.local_weights(WHOLE):
        if name == OUTPUT:
            assert last.global_name(name) is None
            assert last.source_name(name) == EMBEDDING
        else:
            assert WHOLE[last.source_name(name)] == last.local_weights(WHOLE)[name]
    untied = Stages(2, 1, 2, tied=False)
    assert untied.global_name(OUTPUT) == OUTPUT
    alone = Stages(1, 0, 4, tied=True)
    assert alone.local_weights(WHOLE) == WHOLE
    assert all(alone.global_name(name) == name for name in WHOLE)
