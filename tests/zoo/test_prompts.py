"""zoo.prompts: the one JSON-Schema prompt template, and its Jinja twin in tokenizer_config.json."""
import json

import pytest
from transformers import AutoTokenizer

from zoo.prompts import (BOS, CHAT_TEMPLATE, END, json_schema_document, json_schema_messages,
                         json_schema_prompt, render_chat)
from zoo.tokenizer import save_tokenizer, train_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    texts = [json_schema_document(SCHEMA, {"name": f"n{i}", "age": i}) for i in range(50)]
    texts += ["def f(x):\n    return x + 1\n", "Natalia sold clips to 48 of her friends."] * 20
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts, 400), out, model_max_length=512)
    return AutoTokenizer.from_pretrained(out)


def test_prompt_is_the_rendered_chat_with_generation_header():
    prompt = json_schema_prompt(SCHEMA)
    assert prompt.startswith(BOS + "<|user|>\n")
    assert prompt.endswith(f"{END}\n<|assistant|>\n")
    assert '{"type":"object","properties":{"name"' in prompt
    assert prompt == render_chat(json_schema_messages(SCHEMA))


def test_document_is_prompt_then_instance_then_end():
    instance = {"name": "Zoë", "age": 3}
    doc = json_schema_document(SCHEMA, instance)
    assert doc == json_schema_prompt(SCHEMA) + json.dumps(instance, ensure_ascii=False) + END


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"},
     {"role": "assistant", "content": "{}"}, {"role": "user", "content": "again"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_template_matches_python_twin(hf_tokenizer, messages, add_generation_prompt):
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == render_chat(messages, add_generation_prompt)


def test_unknown_role_is_rejected():
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "tool", "content": "x"}])


def test_prompt_tokens_are_a_prefix_of_document_tokens(hf_tokenizer):
    """Training text and a served prompt must split the same way at the prompt/instance boundary."""
    for instance in ({"name": "a"}, ["x", 1], "text", 12, True, None):
        prompt_ids = hf_tokenizer(json_schema_prompt(SCHEMA), add_special_tokens=False)["input_ids"]
        doc_ids = hf_tokenizer(json_schema_document(SCHEMA, instance), add_special_tokens=False)["input_ids"]
        assert doc_ids[: len(prompt_ids)] == prompt_ids
