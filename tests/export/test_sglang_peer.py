"""eagle31's EAGLE-3 HF exports against SGLang 0.5.23's own code: `LlamaForCausalLMEagle3` (`llama_eagle3.py`) for
the Llama drafter, `Eagle3DeepseekV2ForCausalLM` (`kimi_k25_eagle3.py`) for the MLA drafter.

One subprocess in SGLang's venv (`tests/export/sglang_peer.py`, run by `tests/peers.py`) reads every export below as
`--speculative-algorithm EAGLE3 --speculative-draft-model-path <export>` would on one CPU rank: SGLang's config
parsing, its model class and `load_weights`, the target layers it captures, and the drafter's first two steps through
SGLang's own forward and logits processor, which are compared with eagle31's TTT unroll on the same weights; and it
parses docs/export.md's `launch_server` commands with SGLang's own parser. What that script emulates
(a GPU kernel import, the MLA prefill's attention kernel): its docstring; docs/export.md, "Served by SGLang".
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle31.attention.mla import deepseek_rope_frequencies
from eagle31.export import export_drafter
from eagle31.model import Visibility
from eagle31.recipe import load_recipe
from eagle31.rope import inverse_frequencies
from tests.helpers import random_batch, tiny_drafter
from tests.peers import SGLANG_VERSION, run_sglang
from tests.test_mla import KIMI_ROPE, mla_drafter

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = (Path(__file__).parent / "sglang_peer.py").read_text()
DOC = REPO / "docs" / "export.md"
SERVE = re.compile(r"python -m sglang\.launch_server ([^\n`]*)")
T = 7  # prompt positions of the forward check
WINDOW = 4  # the windowed drafter's window (positions, vLLM's and eagle31's convention), below T
OTHER_IDS = (3, 4, 6)  # not SGLang's default (2, 4, 5) for the tiny target's 8 layers
POSITIONS = [0, 1, 2, 17, 63, 255, 1000, 4095]  # the rope rows compared
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {  # a Llama drafter of a DeepSeek target: its yarn block without the mscale fields (eagle31.rope)
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 4.0,
    "beta_slow": 1.0,
}
LLAMA = {
    "eagle31": dict(),
    "eagle3_switches": dict(fc_norm=False, norm_output=False),
    "full_vocab": dict(draft_vocab_size=40),
    "norm_before_fc": dict(fc_norm=False, norm_before_fc=True),
    "wide_target": dict(target_hidden_size=24),
    "other_aux_ids": dict(aux_layer_ids=OTHER_IDS),
    "norm_before_residual": dict(norm_before_residual=True),
    "window": dict(sliding_window=WINDOW),
    "window_without_flag": dict(sliding_window=WINDOW),
    "llama3_rope": dict(rope_parameters=LLAMA3_ROPE),
    "yarn_rope": dict(rope_parameters=YARN_ROPE),
    "parallel": dict(parallel_drafting=True, mask_token_id=5),  # SGLang has no parallel drafting: served as a chain
}
MLA = {
    "mla_eagle31": dict(),
    "mla_eagle3_switches": dict(fc_norm=False, norm_output=False),
    "mla_full_vocab": dict(draft_vocab_size=40),
    "mla_kimi_rope": dict(rope=KIMI_ROPE | {"original_max_position_embeddings": 8}),
}
# what `--speculative-draft-window-size` each case is served with: SGLang reads no window from the config, and its
# window N lets a query see N keys before its own (flashinfer's window_left), eagle31's W counts the query's own
SERVED_WINDOW = {"window": WINDOW - 1}
# the `eagle_config` ids that make SGLang capture the inputs of layers `ids` (docs/export.md, "Served by SGLang"):
# a Llama target adds 1 to each; a DeepSeek/Kimi target adds 1 only when the first is 1 (these do not start at 2)
SGLANG_IDS = {
    "LlamaForCausalLM": lambda ids: [i - 1 for i in ids],
    "DeepseekV2ForCausalLM": lambda ids: list(ids),
}
SGLANG_CLASS = {False: "LlamaForCausalLMEagle3", True: "Eagle3DeepseekV2ForCausalLM"}


def documented_commands() -> list[list[str]]:
    """The argv of each `python -m sglang.launch_server` command of docs/export.md."""
    return [shlex.split(m.group(1)) for m in SERVE.finditer(DOC.read_text())]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_docs_give_an_sglang_command_per_drafter():
    """A Llama and an MLA drafter's command, each serving its recipe's export with its recipe's target."""
    commands = documented_commands()
    drafters = set()
    for argv in commands:
        recipe = flag(argv, "--speculative-draft-model-path").split("/")[1]  # runs/<recipe>/export/eagle3
        assert flag(argv, "--speculative-draft-model-path") == f"runs/{recipe}/export/eagle3", argv
        assert flag(argv, "--speculative-algorithm") == "EAGLE3", argv
        config = load_recipe(REPO / "recipes", [f"recipe={recipe}"])
        assert flag(argv, "--model-path") == config.target.name, recipe
        drafters.add(config.drafter.attention)
    assert drafters == {"llama", "mla"}, commands


def drafter_of(case: str):
    if case in MLA:
        return mla_drafter(seed=3, **MLA[case]).float()
    return tiny_drafter(seed=3, dtype=torch.float32, **LLAMA[case])


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    """({case: (drafter, export dir, the inputs, aux, input ids, what SGLang's code makes of the export)},
    {target class: what SGLang makes of the other ids' export with `eagle_config` added for that target})."""
    root = tmp_path_factory.mktemp("sglang")
    made, request = {}, []
    for case in [*LLAMA, *MLA]:
        drafter = drafter_of(case)
        out = export_drafter(drafter, root / case, "eagle3", dtype="float32")
        aux, _, ids, _ = random_batch(drafter.config, 1, T + 2, seed=5, dtype=torch.float32)
        inputs = {
            "aux": aux[0, :T].contiguous(),
            "tokens": ids[0, 1 : T + 1].contiguous(),  # step 0 at p reads x[p+1] (eagle31.model.Eagle31Drafter.unroll)
            "next_token": ids[0, T + 1 :].contiguous(),  # step 1 at p = T - 1 reads x[p+2]
            "embed": drafter.embed_tokens.weight.detach().contiguous(),
        }
        save_file(inputs, str(root / f"{case}.inputs.safetensors"))
        made[case] = (drafter, out, inputs, aux[:, : T + 2], ids)
        request.append(
            {"path": str(out), "inputs": str(root / f"{case}.inputs.safetensors"), "window": SERVED_WINDOW.get(case)}
        )
    for target, ids in SGLANG_IDS.items():  # the other ids' export with SGLang's `eagle_config` added by hand
        copy = root / f"other_aux_ids-for-{target}"
        copy.mkdir()
        config = json.loads((made["other_aux_ids"][1] / "config.json").read_text())
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids(OTHER_IDS)}
        (copy / "config.json").write_text(json.dumps(config))
        (copy / "model.safetensors").write_bytes((made["other_aux_ids"][1] / "model.safetensors").read_bytes())
        request.append({"path": str(copy)})
    ask = root / "request.json"
    ask.write_text(json.dumps({"exports": request, "positions": POSITIONS, "commands": documented_commands()}))
    answer = run_sglang(PEER_SCRIPT, str(ask))  # 300 s at most; about 40 s on 2 cores
    assert answer["version"] == SGLANG_VERSION
    for path, read in answer["exports"].items():
        assert "crash" not in read, f"{path}: SGLang's code failed on the export:\n{read['crash']}"
    reads = {case: (*made[case], answer["exports"][str(made[case][1])]) for case in made}
    hand_edited = {target: answer["exports"][str(root / f"other_aux_ids-for-{target}")] for target in SGLANG_IDS}
    return reads, hand_edited, answer["commands"]


@pytest.fixture(scope="module")
def sglang_reads(sglang_run):
    return sglang_run[0]


def expected_placement(key: str, tensor: torch.Tensor, tensors: dict, mla: bool) -> list:
    """[SGLang's parameter, first row, end row] that `load_weights` must put an exported tensor in: `midlayer.` is
    `model.layers.0.` (Llama) or `model.midlayer.` (MLA), q/k/v fuse into `qkv_proj`, gate/up into `gate_up_proj`,
    q_a/kv_a into `fused_qkv_a_proj_with_mqa`, in that order; everything else under `model.` but `lm_head`; a
    parallel drafter's `mask_hidden` nowhere (`load_weights` skips a name the model lacks, unsaid)."""
    fused = {
        "q_proj": ("qkv_proj", ()),
        "k_proj": ("qkv_proj", ("q_proj",)),
        "v_proj": ("qkv_proj", ("q_proj", "k_proj")),
        "gate_proj": ("gate_up_proj", ()),
        "up_proj": ("gate_up_proj", ("gate_proj",)),
        "q_a_proj": ("fused_qkv_a_proj_with_mqa", ()),
        "kv_a_proj_with_mqa": ("fused_qkv_a_proj_with_mqa", ("q_a_proj",)),
    }
    if key == "mask_hidden":
        return []
    name = key.replace("midlayer.", "midlayer." if mla else "layers.0.")
    name = name if name.startswith("lm_head.") else f"model.{name}"
    start = 0
    for part, (into, before) in fused.items():
        if f".{part}." in name:
            start = sum(tensors[key.replace(part, b)].shape[0] for b in before)
            name = name.replace(f".{part}.", f".{into}.")
            break
    return [name, start, start + tensor.shape[0]]


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_parses_the_config_and_builds_the_drafter_class(sglang_reads):
    for case, (drafter, _, _, _, _, read) in sglang_reads.items():
        c, mla = drafter.config, case in MLA
        config, model = read["config"], read["model"]
        assert config["class"] == ("_KimiK2ConfigAlias" if mla else "LlamaConfig"), case
        assert config["attention_arch"] == ("MLA" if mla else "MHA"), case
        assert model["class"] == SGLANG_CLASS[mla], case
        fields = config["fields"]
        assert fields["architectures"] == [SGLANG_CLASS[mla]], case
        assert (fields["draft_vocab_size"], fields["vocab_size"]) == (c.draft_vocab_size, c.vocab_size), case
        assert model["num_aux_hidden_states"] == c.num_aux, case
        assert model["load_lm_head_from_target"] is False, case  # the export's own lm_head, not the target's
        if mla:
            for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                assert fields[name] == getattr(c.mla, name), (case, name)


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_load_weights_places_every_exported_tensor_and_leaves_only_the_shared_embedding(sglang_reads):
    for case, (drafter, out, _, _, _, read) in sglang_reads.items():
        mla, model = case in MLA, read["model"]
        tensors = load_file(str(out / "model.safetensors"))
        weights = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
        for key, tensor in weights.items():
            expected = expected_placement(key, tensor, tensors, mla)
            assert model["placed"][key] == ([expected] if expected else []), (case, key)
        assert model["loader_warnings"] == [], case
        # set_embed shares the target's embedding, except with a drafter narrower than its target, whose export
        # carries its own (docs/export.md, "The embedding")
        own_embed = "embed_tokens.weight" in tensors
        assert own_embed == (drafter.config.target_hidden_size != drafter.config.hidden_size), case
        assert model["unloaded"] == ([] if own_embed else ["model.embed_tokens.weight"]), case
        # d2t -> hot_token_id: the target id of each draft id (none for the full vocabulary)
        reduced = drafter.config.draft_vocab_size < drafter.config.vocab_size
        hot = drafter.draft_token_ids().tolist() if reduced else None
        assert model["hot_token_id"] == hot, case


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_builds_the_eagle31_switches_it_reads(sglang_reads):
    for case, (drafter, _, _, _, _, read) in sglang_reads.items():
        c, model, fields = drafter.config, read["model"], read["config"]["fields"]
        assert (fields["fc_norm"], fields["norm_output"]) == (c.fc_norm, c.norm_output), case
        assert model["fc_norm"] == (c.num_aux if c.fc_norm else None), case
        assert model["norm_output"] == c.norm_output, case
        assert model["input_norm"] == (c.norm_before_fc and case not in MLA), case


def assert_steps_match(read: dict, drafter, aux: torch.Tensor, ids: torch.Tensor, case: str) -> None:
    """SGLang's step 0 over the prompt and step 1 at its end = eagle31's unroll of `drafter` (chain steps): the
    fused feature, the state lm_head reads, the feature the next step reads (every position, and the last one's as
    the logits processor captures it), and the draft logits at the last position."""
    out = drafter.double().unroll(aux.double(), ids, ttt_length=2, first_query=0)
    forward, tol = read["forward"], dict(rtol=1e-5, atol=1e-5)
    assert forward["fc_calls"] == 1, case  # step 1 reads step 0's captured feature, not fc of target states
    for k, rows in ((0, slice(0, T)), (1, slice(T - 1, T))):
        got = {name: torch.tensor(v, dtype=torch.float64) for name, v in forward[f"step{k}"].items()}
        state = out.states[k][0, rows]
        feature = state if drafter.config.norm_output else out.hidden[k][0, rows]
        torch.testing.assert_close(got["state"], state, **tol, msg=f"{case} step {k}")
        torch.testing.assert_close(got["feature"], feature, **tol, msg=f"{case} step {k}")
        torch.testing.assert_close(got["captured"], feature[-1:], **tol, msg=f"{case} step {k}")
        torch.testing.assert_close(got["logits"], drafter.lm_head(state[-1:]), **tol, msg=f"{case} step {k}")
    fused = torch.tensor(forward["step0"]["fused"], dtype=torch.float64)
    torch.testing.assert_close(fused, drafter.fuse_aux(aux.double())[0, :T], **tol, msg=case)


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_drafts_what_the_drafter_trained(sglang_reads):
    """Step 0 (the draft extend over the prompt) and step 1 (a draft decode at its end) through SGLang's own model
    forward, logits processor included, = eagle31's unroll on the export's weights; the MLA drafter's prompt takes
    `DeepseekV2AttentionMLA`'s MHA path and its decode the absorbed MLA path (w_kc, w_vc of `post_load_weights`)."""
    for case, (drafter, _, _, aux, ids, read) in sglang_reads.items():
        if case in ("norm_before_residual", "window_without_flag", "parallel"):
            continue  # served otherwise: the tests below
        assert_steps_match(read, drafter, aux, ids, case)
        methods = read["forward"]["mla_methods"]
        assert methods == ([["MHA", "torch_native"], ["MLA", "torch_native"]] if case in MLA else []), case


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_serves_a_parallel_drafter_as_a_chain_drafter(sglang_reads):
    """SGLang 0.5.23 has no parallel drafting for EAGLE-3: it reads neither `mask_token_id` nor `mask_hidden`
    (skipped without a word) and drafts step 1 from step 0's feature, as the same weights drafting in a chain
    (docs/export.md, "Served by SGLang")."""
    drafter, out, _, aux, ids, read = sglang_reads["parallel"]
    assert "mask_hidden" in load_file(str(out / "model.safetensors"))
    assert read["model"]["placed"]["mask_hidden"] == [] and read["model"]["loader_warnings"] == []
    chain = tiny_drafter(seed=3, dtype=torch.float32)
    chain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "mask_hidden"})
    assert_steps_match(read, chain, aux, ids, "parallel")
    parallel = drafter.double().unroll(aux.double(), ids, ttt_length=2).states[1][0, T - 1 : T]
    served = torch.tensor(read["forward"]["step1"]["state"], dtype=torch.float64)
    assert not torch.allclose(served, parallel, rtol=1e-3, atol=1e-3)  # not the mask slot's step


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_ignores_norm_before_residual(sglang_reads):
    """SGLang's EAGLE-3 layers always add the pre-norm hidden state as the residual: a drafter trained with
    `norm_before_residual=true` is served otherwise (docs/export.md, "Served by SGLang")."""
    drafter, _, _, aux, ids, read = sglang_reads["norm_before_residual"]
    state = torch.tensor(read["forward"]["step0"]["state"], dtype=torch.float64)
    ours = drafter.double().unroll(aux.double(), ids, ttt_length=1).states[0][0, :T]
    assert not torch.allclose(state, ours, rtol=1e-3, atol=1e-3)
    plain = tiny_drafter(seed=3, dtype=torch.float64)  # the same weights without the switch: what SGLang computes
    plain.load_state_dict(drafter.state_dict())
    torch.testing.assert_close(
        state, plain.unroll(aux.double(), ids, ttt_length=1).states[0][0, :T], rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_captures_its_default_target_layers_not_the_exported_ids(sglang_run):
    """SGLang takes the target layers from `eagle_config.eagle_aux_hidden_state_layer_ids` only, which the export
    leaves out (vLLM reads the top-level ids): it captures (2, L // 2, L - 3), the inputs of those layers. That is
    the drafter's own ids for every recipe; for others, `eagle_config` added by hand in SGLang's convention for the
    target makes it capture them (docs/export.md, "Served by SGLang")."""
    reads, hand_edited, _ = sglang_run
    for case, (drafter, _, _, _, _, read) in reads.items():
        c, capture = drafter.config, read["capture"]
        assert capture["layer_ids"] is None and capture["use_aux"], case
        L = c.target_num_layers
        for target in SGLANG_IDS:
            assert capture["captured"][target] == [2, L // 2, L - 3], (case, target)
        assert (tuple(capture["captured"]["LlamaForCausalLM"]) == c.aux_layer_ids) == (case != "other_aux_ids"), case
    for target, read in hand_edited.items():
        assert read["capture"]["layer_ids"] == SGLANG_IDS[target](OTHER_IDS)
        assert read["capture"]["captured"][target] == list(OTHER_IDS), target


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_serves_the_window_only_from_its_flag_one_less(sglang_reads):
    """A drafter trained with a window of W positions drafts as trained with `--speculative-draft-window-size W-1`
    (test_sglang_drafts_what_the_drafter_trained, case `window`); the export's `sliding_window` and `layer_types` are
    not read: without the flag the same export attends every key (-1: no window)."""
    for case, (_, _, _, _, _, read) in sglang_reads.items():
        assert read["model"]["sliding_window_size"] == (None if case in MLA else SERVED_WINDOW.get(case, -1)), case
    drafter, _, _, aux, ids, read = sglang_reads["window_without_flag"]
    served = torch.tensor(read["forward"]["step0"]["state"], dtype=torch.float64)
    windowed = drafter.double().unroll(aux.double(), ids, ttt_length=1).states[0][0, :T]
    unwindowed = drafter_of("window").double()
    unwindowed.visibility = Visibility(None)
    full = unwindowed.unroll(aux.double(), ids, ttt_length=1).states[0][0, :T]
    assert not torch.allclose(windowed, full, rtol=1e-3, atol=1e-3)  # T > W: the window matters on this prompt
    torch.testing.assert_close(served, full, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_builds_the_rope_and_softmax_scale_the_drafter_trained_with(sglang_reads):
    """The cos/sin rows of SGLang's rope table and its softmax scale = eagle31's: for the Llama drafter its `get_rope`
    of the exported rope (neox halves) against `eagle31.rope.inverse_frequencies`; for the MLA drafter DeepSeek YaRN,
    which `DeepseekV2AttentionMLA` builds of any rope_scaling (interleaved pairs), against `DeepseekRotaryEmbedding`
    and `MLAAttention.q_scale`."""
    for case, (drafter, _, _, _, _, read) in sglang_reads.items():
        c, model = drafter.config, read["model"]
        rope = model["rope"]
        if case in MLA:
            inv_freq, magnitude, softmax = deepseek_rope_frequencies(c.rope_parameters, c.mla.qk_rope_head_dim)
            assert (rope["class"], rope["is_neox_style"]) == ("DeepseekScalingRotaryEmbedding", False), case
            scale = (c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim) ** -0.5 * softmax
        else:
            inv_freq, magnitude = inverse_frequencies(c.rope_parameters, c.head_dim, c.max_position_embeddings)
            assert rope["is_neox_style"], case
            scale = c.head_dim**-0.5
        assert rope["positions"] == [p for p in POSITIONS if p < rope["table_len"]] and len(rope["positions"]) > 4
        cache = torch.tensor(rope["cos_sin_cache"], dtype=torch.float64)
        angles = torch.tensor(rope["positions"], dtype=torch.float64)[:, None] * inv_freq
        ours = torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude
        torch.testing.assert_close(cache, ours, rtol=1e-5, atol=1e-5, msg=case)
        assert model["attention_scaling"] == pytest.approx(scale, rel=1e-6), case


@pytest.mark.slow  # SGLang's own code in its venv: one subprocess for every case (~1 min on 2 cores)
@pytest.mark.deadline(600)
def test_sglang_parses_the_documented_serving_commands(sglang_run):
    """`launch_server`'s own parser takes every flag of docs/export.md's commands, as written there."""
    _, _, parsed = sglang_run
    for argv, args in zip(documented_commands(), parsed, strict=True):
        assert "error" not in args, (argv, args)
        assert args["model_path"] == flag(argv, "--model-path"), argv
        assert args["speculative_algorithm"] == "EAGLE3", argv
        assert args["speculative_draft_model_path"] == flag(argv, "--speculative-draft-model-path"), argv
        for name in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
            assert args[name[2:].replace("-", "_")] == int(flag(argv, name)), (argv, name)
