"""Stop conditions: EOS, ignore_eos, stop token ids, stop strings on detokenized text, max_tokens,
logprobs; and text prompts through the tokenizer."""
from engine import LLM, SamplingParams

PROMPT = [5, 9, 22, 41, 8, 120, 7]


def greedy(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, **kw))[0]


def test_stop_token_and_eos(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    free = greedy(llm, max_tokens=30, ignore_eos=True)
    stop_id = free.token_ids[6]
    first = free.token_ids.index(stop_id)
    out = greedy(llm, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # The same id as the model's EOS stops generation unless ignore_eos.
    llm.engine.eos_token_ids = frozenset({stop_id})
    out = greedy(llm, max_tokens=30)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert greedy(llm, max_tokens=30, ignore_eos=True).token_ids == free.token_ids


def test_stop_string_cuts_the_text(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    free = greedy(llm, max_tokens=30, ignore_eos=True)
    text = free.text
    stop = text[10:13]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    out = greedy(llm, max_tokens=30, ignore_eos=True, stop=[stop, "never-there"])
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)
    out = greedy(llm, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert out.text == text[: cut + len(stop)]


def test_max_tokens_and_logprobs(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    out = greedy(llm, max_tokens=7, ignore_eos=True, logprobs=3)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert len(out.logprobs) == 7
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top.values()) == lp.logprob  # greedy picks the most likely token


def test_text_prompt_round_trip(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    text = 'Grüße {"name": "Ada"}'
    ids = llm.tokenizer.encode(text)
    by_text = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    by_ids = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
