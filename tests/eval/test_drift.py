"""Attention drift (eagle31.eval.drift, eagle31.eval.drift_report, scripts/diagnose_drift.py)."""

import json
import runpy
from pathlib import Path

import pytest
import torch

from eagle31.eval import drift
from eagle31.eval.drafting import EagleProposer
from eagle31.eval.drift import DepthStats, live_view, rms, split_mass, target_sink_positions, ttt_view
from eagle31.eval.speculative import greedy_trace, speculative_generate
from eagle31.kernels.ttt_attention import reference_attention
from eagle31.ttt import ttt_unroll
from tests.helpers import tiny_drafter
from tests.speculative_helpers import AUX, VOCAB, save_target
from tests.test_mla import mla_config
from tests.tiny_targets import DRAFTER_VOCAB, drafter_sized_llama, tiny_llama

main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "diagnose_drift.py"))["main"]

NEW = 10  # generated tokens per prompt
SINK = 2


def drafter_of(kind: str, **overrides):
    values = mla_config() if kind == "mla" else {}
    return tiny_drafter(seed=2, **{**values, "vocab_size": VOCAB, **overrides})


def uniform(drafter):
    """The same drafter with every query zero: each query attends uniformly to the keys it may see."""
    with torch.no_grad():
        attn = drafter.midlayer.self_attn
        (attn.q_b_proj if drafter.config.attention == "mla" else attn.q_proj).weight.zero_()
    return drafter


@pytest.fixture(scope="module")
def target():
    return drafter_sized_llama()


@pytest.fixture(scope="module")
def traces(target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 13, 9)]
    return [greedy_trace(target, p, aux_layer_ids=AUX, length=NEW + 9) for p in prompts]


# ---------------------------------------------------------------------- the probabilities


def test_reference_attention_hands_out_the_probabilities_it_weights_the_values_with():
    torch.manual_seed(0)
    B, T, nh, nkv, d = 1, 6, 4, 2, 8
    u = torch.randn(d, dtype=torch.float64)
    k0 = torch.zeros(B, T, nkv, d, dtype=torch.float64)
    k0[:, 0] = 40 * u  # only position 0's key scores: all mass on it
    q = u.expand(B, T, nh, d).clone()
    v0 = torch.randn(B, T, nkv, d, dtype=torch.float64)
    chain = ([torch.zeros_like(k0)], [torch.randn_like(v0)])
    segments = torch.ones(B, T, dtype=torch.long)
    seen = []
    out = reference_attention(q, k0, v0, *chain, segments, probe=seen.append)
    assert torch.equal(out, reference_attention(q, k0, v0, *chain, segments))
    (probs,) = seen  # [B, nh, T, 2T]
    assert probs.shape == (B, nh, T, 2 * T)
    masses = split_mass(probs[0], torch.arange(2 * T) < 1, torch.arange(2 * T) >= T)
    torch.testing.assert_close(masses["sink"], torch.ones(T, nh, dtype=torch.float64))
    assert float(masses["own"].max()) < 1e-12 and float(masses["context"].max()) < 1e-12


# ---------------------------------------------------------------------- known attention


def expected_uniform(queries: list[tuple[int, int]], depth: int, sink: int) -> dict[str, list[float]]:
    """Mean masses per depth for queries (position p, chain keys k) attending uniformly to p+1 step-0 keys + k own."""
    out = {"sink": [], "own": []}
    for k in range(depth):
        rows = [(p, k) for p, _ in queries]
        out["sink"].append(sum(min(sink, p + 1) / (p + 1 + j) for p, j in rows) / len(rows))
        out["own"].append(sum(j / (p + 1 + j) for p, j in rows) / len(rows))
    return out


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_uniform_attention_gives_the_constructed_masses_in_both_views(traces, kind):
    drafter = uniform(drafter_of(kind))
    depth = 6  # past any TTT length these tiny drafters stand for
    args = dict(depth=depth, sink_tokens=SINK, max_new_tokens=NEW)
    ttt = ttt_view(drafter, traces, **args).summary()
    queries = [(p, 0) for t in traces for p in range(t.prompt_len - 1, t.prompt_len - 1 + NEW)]
    want = expected_uniform(queries, depth, SINK)
    torch.testing.assert_close(ttt["sink_mass"], want["sink"])
    torch.testing.assert_close(ttt["own_mass"], want["own"])
    for k in range(depth):  # uniform in every head, and the three masses sum to one
        torch.testing.assert_close(ttt["sink_mass_per_head"][k], [want["sink"][k]] * 4)
        assert ttt["sink_mass"][k] + ttt["context_mass"][k] + ttt["own_mass"][k] == pytest.approx(1)
    live, acceptance, error = live_view(drafter, traces, **args)
    live = live.summary()
    roots = []  # the position each live round drafts from
    for t in traces:
        gen = speculative_generate(
            t, EagleProposer(drafter), t.tokens[: t.prompt_len], aux_layer_ids=AUX, max_new_tokens=NEW, k=depth
        )
        root = t.prompt_len - 1
        for a in gen.accepted:
            roots.append((root, 0))
            root += a + 1
    assert live["queries"] == [len(roots)] * depth == [acceptance.rounds] * depth
    want = expected_uniform(roots, depth, SINK)
    torch.testing.assert_close(live["sink_mass"], want["sink"])
    torch.testing.assert_close(live["own_mass"], want["own"])
    assert error < 1e-12  # probs @ V is the attention output the proposer computed


def test_target_sinks_are_where_the_targets_aux_layers_attend_most(target, traces):
    tokens = traces[1].tokens[:-1]
    got = target_sink_positions(target, tokens, AUX, 3)
    assert target.config._attn_implementation == "sdpa"  # restored
    eager = tiny_llama(
        0,
        torch.float64,
        vocab_size=DRAFTER_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=8,
        head_dim=8,
        initializer_range=0.3,
        attn_implementation="eager",
    )
    eager.load_state_dict(target.state_dict())
    weights = eager(input_ids=tokens[None], output_attentions=True).attentions  # per layer [1, heads, T, T]
    T = tokens.numel()
    received = sum(weights[i][0].mean(0).sum(0) for i in AUX) / (torch.arange(T, 0, -1) * len(AUX))
    assert got.tolist() == sorted(received.topk(3).indices.tolist())
    # a uniform drafter puts on them the share of the keys they are
    drafter = uniform(drafter_of("llama"))
    sinks = [target_sink_positions(target, t.tokens[:-1], AUX, 3) for t in traces]
    ttt = ttt_view(drafter, traces, depth=3, sink_tokens=SINK, max_new_tokens=NEW, target_sinks=sinks).summary()
    for k in range(3):
        want = [
            (s <= p).sum().item() / (p + 1 + k)
            for t, s in zip(traces, sinks)
            for p in range(t.prompt_len - 1, t.prompt_len - 1 + NEW)
        ]
        assert ttt["target_sink_mass"][k] == pytest.approx(sum(want) / len(want))
    live, _, _ = live_view(drafter, traces, depth=3, sink_tokens=SINK, max_new_tokens=NEW, target_sinks=sinks)
    assert 0 < live.summary()["target_sink_mass"][0] < 1


# ---------------------------------------------------------------------- hidden RMS, acceptance


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("norm_output", [True, False])
def test_hidden_rms_and_acceptance_equal_a_direct_computation(traces, kind, norm_output):
    drafter = drafter_of(kind, norm_output=norm_output)
    depth = 4
    got = ttt_view(drafter, traces, depth=depth, sink_tokens=SINK, max_new_tokens=NEW).summary()
    fed, out, normed, reached, accepted = ([[] for _ in range(depth)] for _ in range(5))
    for t in traces:  # one trace at a time, the plain unroll, RMS written out
        n = t.aux.shape[0]
        unroll = ttt_unroll(
            drafter, t.aux[None].double(), t.tokens[None, :n], ttt_length=depth, attention_kernel="flash"
        )
        feature = drafter.fuse_aux(t.aux[None].double())
        alive = torch.ones(NEW, dtype=torch.bool)
        rows = slice(t.prompt_len - 1, t.prompt_len - 1 + NEW)
        for k in range(depth):
            fed[k] += feature[0, rows].pow(2).mean(-1).sqrt().tolist()
            out[k] += unroll.hidden[k][0, rows].pow(2).mean(-1).sqrt().tolist()
            normed[k] += unroll.states[k][0, rows].pow(2).mean(-1).sqrt().tolist()
            draft = drafter.draft_to_target(drafter.lm_head(unroll.states[k][0, rows]).argmax(-1))
            reached[k].append(int(alive.sum()))
            alive &= draft == t.tokens[t.prompt_len + 1 + k : t.prompt_len + 1 + k + NEW]
            accepted[k].append(int(alive.sum()))
            feature = unroll.states[k] if norm_output else unroll.hidden[k]
    mean = lambda xs: [sum(x) / len(x) for x in xs]  # noqa: E731
    torch.testing.assert_close(got["fed_rms"], mean(fed))
    torch.testing.assert_close(got["out_rms"], mean(out))
    torch.testing.assert_close(got["out_norm_rms"], mean(normed))
    assert got["reached"] == [sum(r) for r in reached] and got["accepted"] == [sum(a) for a in accepted]
    if not norm_output:  # EAGLE 3 feeds the pre-norm output forward
        torch.testing.assert_close(got["fed_rms"][1:], got["out_rms"][:-1])
    # live: depth 1 reads the target's fused feature at each round's root
    live, acceptance, _ = live_view(drafter, traces, depth=depth, sink_tokens=SINK, max_new_tokens=NEW)
    roots = []
    for t in traces:
        gen = speculative_generate(
            t, EagleProposer(drafter), t.tokens[: t.prompt_len], aux_layer_ids=AUX, max_new_tokens=NEW, k=depth
        )
        root = t.prompt_len - 1
        for a in gen.accepted:
            with torch.no_grad():
                roots.append(float(rms(drafter.fuse_aux(t.aux[root : root + 1].double()))[0]))
            root += a + 1
    assert live.summary()["fed_rms"][0] == pytest.approx(sum(roots) / len(roots))
    summary = live.summary()
    assert summary["reached"] == [acceptance.rounds] + acceptance.accepted_at[:-1]
    assert summary["accepted"] == acceptance.accepted_at
    for rate, a, r in zip(summary["conditional_acceptance_rate"], summary["accepted"], summary["reached"]):
        assert rate == (a / r if r else None)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_live_depth_one_is_the_teacher_forced_attention_at_each_rounds_root(traces, kind):
    # a trained-like (non-uniform) drafter: at depth 1 both views read the same step-0 keys with the
    # same query, so they differ only in which positions are queries (live: the rounds' roots)
    drafter = drafter_of(kind)
    live, _, _ = live_view(drafter, traces, depth=3, sink_tokens=SINK, max_new_tokens=NEW)
    sink, context = [], []
    for t in traces:
        n = t.aux.shape[0]
        step0 = {}
        probe = lambda k, probs, step0=step0: step0.setdefault("probs", probs[0]) if k == 0 else None  # noqa: E731
        with torch.no_grad():
            drafter.unroll(t.aux[None], t.tokens[None, :n], ttt_length=1, probe=probe)
        probs = step0["probs"].double()  # [heads, T, T]
        gen = speculative_generate(
            t, EagleProposer(drafter), t.tokens[: t.prompt_len], aux_layer_ids=AUX, max_new_tokens=NEW, k=3
        )
        root = t.prompt_len - 1
        for a in gen.accepted:
            sink.append(float(probs[:, root, :SINK].sum(-1).mean()))
            context.append(float(probs[:, root, SINK:].sum(-1).mean()))
            root += a + 1
    got = live.summary()
    assert len(set(sink)) > 1  # not uniform: the roots see different masses
    assert got["sink_mass"][0] == pytest.approx(sum(sink) / len(sink), abs=1e-6)
    assert got["context_mass"][0] == pytest.approx(sum(context) / len(context), abs=1e-6)
    assert got["own_mass"][0] == 0


# ---------------------------------------------------------------------- no side effects, packing


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_the_diagnostic_leaves_drafting_bit_identical(traces, kind):
    drafter = drafter_of(kind)
    for t in traces:
        prompt = t.tokens[: t.prompt_len]
        plain, watched = EagleProposer(drafter), EagleProposer(drafter, probe=_Counter())
        for proposer in (plain, watched):
            proposer.extend(t.aux[: t.prompt_len], t.tokens[1 : t.prompt_len + 1])
        assert torch.equal(plain.draft_chain(7), watched.draft_chain(7))
        assert watched.probe.calls == 7  # the root and six chain steps
        a = speculative_generate(t, EagleProposer(drafter), prompt, aux_layer_ids=AUX, max_new_tokens=NEW, k=5)
        b = speculative_generate(
            t, EagleProposer(drafter, probe=_Counter()), prompt, aux_layer_ids=AUX, max_new_tokens=NEW, k=5
        )
        assert (a.tokens, a.accepted) == (b.tokens, b.accepted)
    # teacher-forced: the probe does not change the reference unroll's outputs
    t = traces[0]
    n = t.aux.shape[0]
    args = (t.aux[None].double(), t.tokens[None, :n])
    plain = drafter.unroll(*args, ttt_length=3)
    watched = drafter.unroll(*args, ttt_length=3, probe=lambda k, p: None)
    assert all(torch.equal(x, y) for x, y in zip(plain.hidden, watched.hidden))


class _Counter:
    def __init__(self):
        self.calls = 0

    def observe(self, *args, chain):
        self.calls += 1


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_packed_prompts_give_what_single_prompts_give(traces, kind):
    drafter = drafter_of(kind)
    args = dict(depth=5, sink_tokens=SINK, max_new_tokens=NEW)
    packed = ttt_view(drafter, traces, pack_tokens=4096, **args).summary()
    single = ttt_view(drafter, traces, pack_tokens=1, **args).summary()
    assert packed["queries"] == single["queries"] == [NEW * len(traces)] * 5
    assert packed["accepted"] == single["accepted"]
    for key in ("sink_mass", "own_mass", "context_mass", "fed_rms", "out_rms", "out_norm_rms"):
        torch.testing.assert_close(packed[key], single[key])


def test_depth_stats_summary_averages_per_query():
    stats = DepthStats(depth=2, heads=2)
    stats.add_attention(
        1, {"sink": torch.tensor([[1.0, 0.0], [0.5, 0.5]]), "context": torch.zeros(2, 2), "own": torch.zeros(2, 2)}
    )
    stats.add_states(1, torch.full((2, 4), 2.0), torch.full((2, 4), 3.0), torch.ones(2, 4))
    s = stats.summary()
    assert s["queries"] == [2, 0]
    assert s["sink_mass"][0] == pytest.approx(0.5) and s["sink_mass_per_head"][0] == pytest.approx([0.75, 0.25])
    assert (s["fed_rms"][0], s["out_rms"][0], s["out_norm_rms"][0]) == pytest.approx((2.0, 3.0, 1.0))
    stats.reached, stats.accepted = [4, 0], [3, 0]
    assert stats.summary()["conditional_acceptance_rate"] == [0.75, None]  # no query reached depth 2


# ---------------------------------------------------------------------- the script


@pytest.mark.slow
def test_script_end_to_end(tmp_path, capsys, monkeypatch):
    target_dir = save_target(tmp_path / "target")
    tiny_drafter(seed=0, vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / "e31")
    tiny_drafter(seed=1, vocab_size=VOCAB, dtype=torch.float32, fc_norm=False, norm_output=False).save(tmp_path / "e3")
    data = tmp_path / "heldout.jsonl"
    records = [{"messages": [{"role": "user", "content": "write a python function"}]}, {"prompt": "the sum of two"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "drift"
    args = [
        f"drafter=eagle3={tmp_path}/e3,eagle31={tmp_path}/e31",
        f"target={target_dir}",
        f"data={data}",
        "depth=3",
        "max_new_tokens=6",
        "sink_tokens=1",
        "target_sinks=2",
        "device=cpu",
        f"out={out}",
    ]
    assert main(args) == 0
    report = json.loads((out / "drift.json").read_text())
    assert [(r["drafter"], r["view"]) for r in report["results"]] == [
        ("eagle3", "ttt"),
        ("eagle3", "live"),
        ("eagle31", "ttt"),
        ("eagle31", "live"),
    ]
    assert report["settings"]["drafter_settings"]["eagle3"]["fc_norm"] is False
    for r in report["results"]:
        assert len(r["sink_mass"]) == 3 and len(r["target_sink_mass"]) == 3 and r["queries"][0] > 0
    for name in ("drift_ttt.png", "drift_live.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert (out / "drift.md").read_text().strip() in capsys.readouterr().out
    # MT-Bench: both turns of each question under a system prompt, as one split
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "coding", "turns": ["write a function", "sum of two"]}) + "\n"
    )
    mt = [
        args[0],
        args[1],
        f"questions={questions}",
        "system_prompt=you are a helpful assistant",
        "split=unseen_system",
        "depth=2",
        "max_new_tokens=4",
        "device=cpu",
        f"out={tmp_path}/mt",
    ]
    traced = drift.trace_mt_bench
    rendered_with = []
    monkeypatch.setattr(
        drift, "trace_mt_bench", lambda *a, **kw: rendered_with.append(kw["template_kwargs"]) or traced(*a, **kw)
    )
    assert main([*mt, 'chat_template_kwargs={"thinking": true}']) == 0
    assert rendered_with == [{"thinking": True}]  # the questions render as the recipe's prompts do
    report = json.loads((tmp_path / "mt" / "drift.json").read_text())
    assert {r["split"] for r in report["results"]} == {"unseen_system"} and report["settings"]["mt_bench"]["turns"] == 2
    assert all(r["prompts"] == 2 for r in report["results"])
    # bad input: one line, before any model is read
    assert main(args + [f"questions={questions}"]) == 2
    assert "exactly one of data= (JSONL prompt files) and questions=" in capsys.readouterr().err
    assert main(args[:3] + ["depth=0", f"out={tmp_path}/x"]) == 2
    assert "depth must be a positive integer" in capsys.readouterr().err
    assert main([args[0], args[1], f"data={tmp_path}/missing.jsonl", f"out={tmp_path}/y"]) == 2
    assert "prompt file not found" in capsys.readouterr().err
