"""Issue 26 item 1: the verifier's stop set is where the engines take it from.

SGLang 0.5.23 (``ModelConfig._get_hf_eos_token_id``: config.json eos | generation_config.json eos) and
HF ``generate`` (the model's generation_config) stop on a token that only generation_config.json lists;
so must 01 (local and server regeneration), 02 (loss-mask turn end, recorded in data_config.json) and
05 (decoding stop). Llama-3.1's ``<|eom_id|>`` is a built-in end of turn."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from eagle3.chat.template import ChatOptions, end_of_turn_ids, generation_prompt
from eagle3.config import PromptsConfig, VerifierConfig
from eagle3.errors import UserError
from eagle3.verifier.load import config_eos_ids, load_tokenizer, load_verifier

MAX_NEW = 12
MSG = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def verifier_with_extra_stop(smollm_tokenizer, tmp_path_factory):
    """A random tiny Llama verifier (untied, wide init: its greedy answers vary token to token) with
    SmolLM2's tokenizer, whose generation_config.json adds token X = the 4th new token of its greedy
    answer (X is not among the first three and is no stop token before)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smollm_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.5,
        bos_token_id=smollm_tokenizer.bos_token_id,
        eos_token_id=smollm_tokenizer.eos_token_id,
    )
    base = tmp_path_factory.mktemp("verifier")
    LlamaForCausalLM(cfg).save_pretrained(base)
    smollm_tokenizer.save_pretrained(base)
    model, tok = load_verifier(VerifierConfig(path=str(base), dtype="float32"), device="cpu")
    prompt = tok(generation_prompt(tok, MSG, ChatOptions()), add_special_tokens=False)["input_ids"]
    stops = sorted(end_of_turn_ids(tok))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
    assert len(out) == MAX_NEW and not set(out) & set(
        stops
    )  # the random model never stops by itself
    k = next(i for i in range(3, MAX_NEW) if out[i] not in out[:i])
    x = out[k]
    copy = tmp_path_factory.mktemp("verifier-x")
    shutil.copytree(base, copy, dirs_exist_ok=True)
    (copy / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.eos_token_id, x], "bos_token_id": tok.bos_token_id})
    )
    return SimpleNamespace(path=copy, prompt=prompt, answer=out, k=k, x=x)


def test_stop_set_includes_generation_config_eos_and_regeneration_stops_there_like_hf_generate(
    verifier_with_extra_stop,
):
    v = verifier_with_extra_stop
    vcfg = VerifierConfig(path=str(v.path), dtype="float32")
    model, tok = load_verifier(vcfg, device="cpu")
    assert v.x in end_of_turn_ids(tok) and v.x in config_eos_ids(vcfg)
    # HF generate with the folder's own generation_config (no eos given): stops at X, X included
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([v.prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )[0, len(v.prompt) :].tolist()
    assert hf == v.answer[: v.k + 1]
    # 01 in-process regeneration: the same stop (stop token excluded from the stored tokens)
    from eagle3.regen.regenerate import regenerate

    stats: dict = {}
    conv = regenerate(
        model,
        tok,
        [{"id": "c0", "messages": MSG + [{"role": "assistant", "content": "x"}]}],
        MAX_NEW,
        1,
        stats=stats,
    )[0]
    assert conv["messages"][-1]["tokens"] == hf[:-1] == v.answer[: v.k]
    # 01 via an SGLang server: the request's stop_token_ids carry X
    from eagle3.regen.server_protocols import SGLangGenerate

    payload, _ = SGLangGenerate(
        load_tokenizer(vcfg), PromptsConfig(source="x.jsonl"), ChatOptions()
    ).request(MSG)
    assert v.x in payload["sampling_params"]["stop_token_ids"]
    # 05: greedy decoding with the benchmark's stop set stops at X as well (kept in its output)
    from eagle3.decoding.decode import greedy_generate_batch

    g = greedy_generate_batch(model, [v.prompt], MAX_NEW, sorted(end_of_turn_ids(tok)))
    assert g.tokens[0] == hf


def test_loss_mask_turn_end_uses_the_same_stop_set(verifier_with_extra_stop):
    """02: a regenerated answer that stopped at X (tokens without X) is masked up to the template's end of turn."""
    from eagle3.chat.samples import conversation_samples

    v = verifier_with_extra_stop
    tok = load_tokenizer(VerifierConfig(path=str(v.path)))
    ans = v.answer[: v.k]
    msgs = MSG + [
        {"role": "assistant", "content": tok.decode(ans, skip_special_tokens=True), "tokens": ans}
    ]
    s = conversation_samples(tok, msgs, 512).samples[0]
    n = len(v.prompt)
    assert s.input_ids[:n] == v.prompt and s.input_ids[n : n + len(ans)] == ans
    assert s.loss_mask[:n] == [0] * n and all(s.loss_mask[n : n + len(ans)])
    assert s.input_ids[n + len(ans)] in end_of_turn_ids(tok) and s.loss_mask[n + len(ans)] == 1
    # as 01 now records it: the answer stopped at X, not at the template's <|im_end|>, which leaves the loss
    msgs[-1]["stop_token"] = v.x
    s = conversation_samples(tok, msgs, 512).samples[0]
    assert s.input_ids[n + len(ans)] == tok.convert_tokens_to_ids("<|im_end|>") != v.x
    assert all(s.loss_mask[n : n + len(ans)]) and s.loss_mask[n + len(ans) :] == [0] * (
        len(s.loss_mask) - n - len(ans)
    )


def _answer_by(engine: str, v) -> dict:
    """The regenerated assistant message of MSG by one of 01's paths on the verifier that stops at X."""
    vcfg = VerifierConfig(path=str(v.path), dtype="float32")
    if (
        engine == "sglang"
    ):  # the endpoint path: a stand-in SGLang server decoding greedily with the same model
        from standin_server import ModelBackend, StandInServer

        from eagle3.regen.regen_server import regenerate_via_server
        from eagle3.settings.prompts import RegenServerConfig

        model, tok = load_verifier(vcfg, device="cpu")
        with StandInServer(ModelBackend(model, tok), tok) as srv:
            pc = PromptsConfig(
                source="x",
                regenerate=True,
                regenerate_via="sglang",
                max_new_tokens=MAX_NEW,
                server=RegenServerConfig(urls=[srv.url]),
            )
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                out = regenerate_via_server(
                    [{"id": "c0", "messages": MSG}],
                    load_tokenizer(vcfg),
                    pc,
                    ChatOptions(),
                    partial_path=f"{d}/p.jsonl",
                    settings={"v": 1},
                )
        return out[0]["messages"][-1]
    from eagle3.regen.regenerate import regenerate

    model, tok = load_verifier(vcfg, device="cpu")
    return regenerate(model, tok, [{"id": "c0", "messages": MSG}], MAX_NEW, 2, engine=engine)[0][
        "messages"
    ][-1]


@pytest.mark.parametrize("engine", ["static", "slots", "hf_continuous", "sglang"])
def test_every_path_records_the_stop_id_and_02_leaves_the_template_end_of_turn_out(
    verifier_with_extra_stop, engine
):
    """Every regeneration path (the three in-process engines, the SGLang endpoint) writes ``stop_token: X`` on an
    answer the verifier ended on X (a generation_config stop id, not the template's ``<|im_end|>``), and 02 gives
    the ``<|im_end|>`` the template appends there no loss: the drafter is not taught a token the verifier did not
    emit. Before, the message held only ``tokens`` and 02 trained on ``<|im_end|>``."""
    from eagle3.chat.samples import conversation_samples

    v = verifier_with_extra_stop
    m = _answer_by(engine, v)
    assert m["tokens"] == v.answer[: v.k] and m["stop_token"] == v.x and "truncated" not in m
    tok = load_tokenizer(VerifierConfig(path=str(v.path)))
    s = conversation_samples(tok, MSG + [m], 512).samples[0]
    n, k = len(v.prompt), v.k
    assert s.input_ids[n : n + k] == v.answer[:k] and s.input_ids[
        n + k
    ] == tok.convert_tokens_to_ids("<|im_end|>")
    assert (
        s.loss_mask[:n] == [0] * n
        and s.loss_mask[n : n + k] == [1] * k
        and not any(s.loss_mask[n + k :])
    )


def test_openai_answer_records_the_stop_id_the_server_names(smollm_tokenizer):
    """OpenAI chat completions carry no token ids; the stop id is recorded when the choice names it (SGLang
    ``matched_stop``, vLLM ``stop_reason``), not for a stop string or vLLM's None (the tokenizer's EOS)."""
    from eagle3.regen.server_protocols import OpenAIChat

    proto = OpenAIChat(smollm_tokenizer, PromptsConfig(source="x.jsonl"), ChatOptions())

    def parse(**choice):
        return proto.parse({"choices": [{"message": {"content": "Red."}, **choice}]}).message()

    assert parse(finish_reason="stop", matched_stop=0)["stop_token"] == 0
    assert parse(finish_reason="stop", stop_reason=2)["stop_token"] == 2
    assert "stop_token" not in parse(finish_reason="stop", stop_reason=None)
    assert "stop_token" not in parse(finish_reason="stop", matched_stop="</s>")
    cut = parse(finish_reason="length", matched_stop=None)
    assert cut["truncated"] is True and "stop_token" not in cut


def test_eom_id_and_config_eos_lists():
    class Llama31Tok:
        eos_token_id = 128009

        def get_vocab(self):
            return {
                "<|begin_of_text|>": 128000,
                "<|end_of_text|>": 128001,
                "<|eom_id|>": 128008,
                "<|eot_id|>": 128009,
            }

    assert end_of_turn_ids(Llama31Tok()) == {128001, 128008, 128009}


def test_config_eos_int_list_and_bad_value(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"eos_token_id": 2, "text_config": {"eos_token_id": [7]}})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 9]}))
    assert config_eos_ids(VerifierConfig(path=str(tmp_path))) == {0, 2, 7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    gen = tmp_path / "generation_config.json"
    with pytest.raises(UserError) as e:
        config_eos_ids(VerifierConfig(path=str(tmp_path)))
    assert str(e.value) == (
        f"{gen}: field 'eos_token_id' should be a list, got '</s>'; a token id or a list of token ids"
    )
    gen.write_text(json.dumps({"eos_token_id": [1, -2]}))
    with pytest.raises(
        UserError, match=r"field 'eos_token_id\[1\]' should be greater than or equal to 0"
    ):
        config_eos_ids(VerifierConfig(path=str(tmp_path)))
