#!/usr/bin/env python3
"""Writes strata-train's embedded default (bindings/python/strata/train/default/): a small chat
dataset generated from a fixed seed (chat.jsonl: short conversations about arithmetic, words,
colours and counting, written here, so the data is ours to license), a byte-level BPE
tokenizer trained on it with the `tokenizers` library (tokenizer.json, with a chat template
whose assistant turns are marked with {% generation %}), and a small Llama-style config
(config.json, no weights: strata-train initializes them from the seed). Deterministic: running
it again rewrites the same files.

    python scripts/make-train-default.py        # needs tokenizers and transformers
"""
import json
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parents[1] / "bindings/python/strata/train/default"
VOCAB = 640
CONVERSATIONS = 400

SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is "<|role|>\n{content}<|end|>"; the assistant's content and its <|end|> are what is
# trained (the {% generation %} span that apply_chat_template's assistant mask reads).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

COLOURS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black",
           "a banana": "yellow", "a tomato": "red", "an orange": "orange", "a plum": "purple"}
WORDS = ["river", "garden", "pencil", "window", "candle", "rocket", "forest", "marble",
         "violin", "planet", "ladder", "basket", "tunnel", "silver", "button", "dragon"]
NUMBER_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful tutor."]


def arithmetic(r):
    a, b = r.randint(2, 60), r.randint(2, 40)
    op = r.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return "What is %d %s %d?" % (a, op, b), "%d %s %d = %d." % (a, op, b, value)


def reverse(r):
    w = r.choice(WORDS)
    return "Spell '%s' backwards." % w, "'%s' backwards is '%s'." % (w, w[::-1])


def colour(r):
    thing = r.choice(sorted(COLOURS))
    return "What colour is %s?" % thing, "%s is %s." % (thing.capitalize(), COLOURS[thing])


def count_letters(r):
    w = r.choice(WORDS)
    letter = r.choice(sorted(set(w)))
    n = w.count(letter)
    return ("How many times does the letter '%s' appear in '%s'?" % (letter, w),
            "The letter '%s' appears %s time%s in '%s'." % (letter, NUMBER_NAMES[n],
                                                            "" if n == 1 else "s", w))


def number_word(r):
    n = r.randint(0, 12)
    return "Write the number %d in words." % n, "%d is written '%s'." % (n, NUMBER_NAMES[n])


def sort_words(r):
    words = r.sample(WORDS, 3)
    return ("Sort these words alphabetically: %s." % ", ".join(words),
            "In alphabetical order: %s." % ", ".join(sorted(words)))


TASKS = [arithmetic, reverse, colour, count_letters, number_word, sort_words]


def conversation(r):
    messages = []
    if r.random() < 0.3:
        messages.append({"role": "system", "content": r.choice(SYSTEMS)})
    for _ in range(1 if r.random() < 0.7 else 2):
        question, answer = r.choice(TASKS)(r)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    OUT.mkdir(parents=True, exist_ok=True)
    r = random.Random(20250)
    rows = [conversation(r) for _ in range(CONVERSATIONS)]
    with open(OUT / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((m["content"] for row in rows for m in row["messages"]), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|bos|>",
                                        eos_token="<|end|>", pad_token="<|pad|>",
                                        chat_template=CHAT_TEMPLATE, model_max_length=512)
    tokenizer.save_pretrained(OUT)
    # transformers 5 names the class TokenizersBackend; 4.x knows it as PreTrainedTokenizerFast,
    # which 5 still resolves: the default loads under either.
    settings = json.loads((OUT / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (OUT / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=172,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    config.save_pretrained(OUT)
    print("wrote %s: %d conversations, %d tokens in the vocabulary"
          % (OUT, len(rows), len(tokenizer)))


if __name__ == "__main__":
    main()
