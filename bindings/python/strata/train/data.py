"""strata-train's data: files or a Hub dataset read by `datasets`, each row rendered and
tokenized by the model's tokenizer (chat through its chat template), labels -100 on what is not
trained (the prompt, by default), rows packed or truncated to the sequence length.

Formats, found from the columns when --format is auto:
- chat: `messages` (OpenAI: role/content) or `conversations` (ShareGPT: from/value, human/gpt)
- alpaca: `instruction`, optional `input`, `output` (a user turn and an assistant turn through
  the chat template; Alpaca's own prompt where the tokenizer has no template)
- text: `text`, every token trained, always packed.

Text only: rows with images or videos (an `images`/`image`/`videos`/`video` column, or a message
whose content holds an image or video entry) are refused, naming what was found
(refuse_media): a vision-language model's image+text batches need its processor's pixel
tensors beside the ids, which this command does not build; strata.torch trains them from
Python (docs/python-guide.md, "Vision-language models").

The completion tokens of a chat are those of the assistant turns. Where the chat template
marks them ({% generation %}), transformers' apply_chat_template(return_assistant_tokens_mask)
says which they are; other templates are rendered up to each assistant turn with
add_generation_prompt (the prompt) and through it (the prompt and the turn), and the tokens of
the text in between are the turn's, found through the fast tokenizer's offsets. Packing (the
rows of examples laid end to end, cut every --seq-len tokens) is written here: `datasets` and
transformers have none for causal LM rows with labels."""

import json
import os
import re

from .config import UsageError

FORMATS = ("text", "alpaca", "chat")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
                 ".csv": "csv"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system"}
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that "
                 "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                 "{input}### Response:\n")
IGNORE = -100
GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


def _root_cause(error):
    """The error and what caused it, innermost last: datasets wraps a file's parse error (the
    JSON line at fault) in "An error occurred while generating the dataset"."""
    said, seen = [str(error)], {id(error)}
    cause = error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if str(cause) and str(cause) not in said:
            said.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    return ": ".join(said)


def load(specs, split="train", what="--data"):
    """A datasets.Dataset of `specs`: local files (of one kind, by extension) or one Hub name."""
    import datasets
    specs = list(specs)
    local = [s for s in specs if os.path.exists(s)]
    if local and len(local) == len(specs):
        kinds = {FILE_BUILDERS.get(_extension(s)) for s in specs}
        if None in kinds or len(kinds) != 1:
            raise UsageError("%s %s: files of one kind are read: %s"
                             % (what, " ".join(specs), ", ".join(sorted(FILE_BUILDERS))))
        files = [os.path.join(s, f) for s in specs for f in sorted(os.listdir(s))] \
            if all(os.path.isdir(s) for s in specs) else specs
        try:
            return datasets.load_dataset(kinds.pop(), data_files=files, split="train")
        except Exception as e:
            raise UsageError("%s %s: cannot be read: %s"
                             % (what, " ".join(specs), _root_cause(e))) from None
    missing = [s for s in specs if not os.path.exists(s)]
    if len(specs) > 1 or any(_extension(s) in FILE_BUILDERS or s.startswith((".", "/", "~"))
                             for s in missing):
        raise UsageError("%s: no such file: %s" % (what, ", ".join(missing)))
    try:
        return datasets.load_dataset(specs[0], split=split)
    except Exception as e:
        raise UsageError("%s %s: not a local file, and the Hub dataset could not be loaded "
                         "(%s: %s)" % (what, specs[0], type(e).__name__, e)) from None


def _extension(path):
    return os.path.splitext(path)[1].lower() if os.path.isfile(path) or "." in path else ""


MEDIA_COLUMNS = ("image", "images", "video", "videos")
MEDIA_REFUSAL = ("strata-train trains on text only: %s; images and videos need the model's "
                 "processor and pixel tensors beside the ids, which this command does not "
                 "build. Train a vision-language model on image+text batches through "
                 "strata.torch in Python (docs/python-guide.md, \"Vision-language models\"), "
                 "or drop the media for text-only data")


def detect_format(columns, requested, what="--data"):
    """The format of rows with `columns`, checked against --format; data with images or videos
    refused (MEDIA_REFUSAL)."""
    columns = set(columns)
    media = sorted(columns & set(MEDIA_COLUMNS))
    if media:
        raise UsageError(MEDIA_REFUSAL % ("%s has the column%s %s" % (
            what, "s" if len(media) > 1 else "", ", ".join("`%s`" % c for c in media))))
    found = ("chat" if columns & {"messages", "conversations"} else
             "alpaca" if {"instruction", "output"} <= columns else
             "text" if "text" in columns else None)
    if requested == "auto":
        if found is None:
            raise UsageError("%s: cannot tell the format from the columns %s: chat needs "
                             "`messages` or `conversations`, alpaca `instruction` and "
                             "`output`, text `text`" % (what, sorted(columns)))
        return found
    needs = {"chat": "`messages` or `conversations`", "alpaca": "`instruction` and `output`",
             "text": "`text`"}[requested]
    ok = {"chat": bool(columns & {"messages", "conversations"}),
          "alpaca": {"instruction", "output"} <= columns, "text": "text" in columns}[requested]
    if not ok:
        raise UsageError("%s: --format %s needs the column%s %s; the data has %s"
                         % (what, requested, "s" if " and " in needs else "", needs,
                            sorted(columns)))
    return requested


def messages_of(row):
    """A chat row's messages as [{"role", "content"}] (ShareGPT's from/value mapped)."""
    if row.get("messages") is not None:
        out = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    else:
        out = []
        for m in row["conversations"]:
            role = SHAREGPT_ROLES.get(m.get("from"))
            if role is None:
                raise UsageError("a ShareGPT turn has from=%r; expected one of %s"
                                 % (m.get("from"), ", ".join(sorted(SHAREGPT_ROLES))))
            out.append({"role": role, "content": m["value"]})
    for m in out:
        refuse_media(m)
    return out


def refuse_media(message):
    """A message whose content is a list of parts (transformers' and OpenAI's multimodal form)
    with an image or video part is refused (MEDIA_REFUSAL); text parts pass."""
    if not isinstance(message["content"], (list, tuple)):
        return
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise UsageError(MEDIA_REFUSAL % ("a %s message has a content part of type %r"
                                              % (message["role"], kind)))


class Encoder:
    """Turns one row into {"input_ids", "labels"} (labels -100 where nothing is trained)."""

    def __init__(self, tokenizer, fmt, train_on_prompt=False):
        self.tokenizer, self.fmt, self.train_on_prompt = tokenizer, fmt, train_on_prompt
        self.template = getattr(tokenizer, "chat_template", None)
        if fmt == "chat" and not self.template:
            raise UsageError("chat data needs a tokenizer with a chat template; %s has none "
                             "(give --tokenizer one that has, or data in another format)"
                             % getattr(tokenizer, "name_or_path", "the tokenizer"))

    def __call__(self, row):
        _require(row, self.fmt)
        if self.fmt == "text":
            ids = self.tokenizer(row["text"], add_special_tokens=True)["input_ids"]
            if self.tokenizer.eos_token_id is not None:
                ids = ids + [self.tokenizer.eos_token_id]
            return {"input_ids": ids, "labels": list(ids)}
        if self.fmt == "alpaca" and not self.template:
            return self._alpaca_plain(row)
        messages = messages_of(row) if self.fmt == "chat" else _alpaca_messages(row)
        ids, trained = chat_completion_mask(self.tokenizer, messages)
        labels = list(ids) if self.train_on_prompt else \
            [i if t else IGNORE for i, t in zip(ids, trained)]
        return {"input_ids": ids, "labels": labels}

    def _alpaca_plain(self, row):
        extra = row.get("input") or ""
        prompt = ALPACA_PROMPT.format(instruction=row["instruction"],
                                      input="### Input:\n%s\n\n" % extra if extra else "")
        tok = self.tokenizer
        prompt_ids = tok(prompt, add_special_tokens=True)["input_ids"]
        answer = tok(row["output"], add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            answer = answer + [tok.eos_token_id]
        ids = prompt_ids + answer
        labels = list(ids) if self.train_on_prompt else [IGNORE] * len(prompt_ids) + answer
        return {"input_ids": ids, "labels": labels}


def _require(row, fmt):
    """A row of a file whose other rows have the format's fields may lack them (None)."""
    needs = {"text": [("text",)], "alpaca": [("instruction",), ("output",)],
             "chat": [("messages", "conversations")]}[fmt]
    for fields in needs:
        if all(row.get(f) is None for f in fields):
            raise UsageError("a row has no %s (the %s format needs it): %s"
                             % (" or ".join("`%s`" % f for f in fields), fmt,
                                json.dumps(row, default=str)[:200]))


def _alpaca_messages(row):
    extra = row.get("input") or ""
    user = row["instruction"] + ("\n\n" + extra if extra else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def chat_completion_mask(tokenizer, messages):
    """(token ids, [bool]) of a conversation rendered by the tokenizer's chat template: True on
    the assistant turns' tokens."""
    if GENERATION_MARK.search(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    return chat_completion_mask_by_prefix(tokenizer, messages)


def chat_completion_mask_by_prefix(tokenizer, messages):
    """The same for a template without {% generation %}: each assistant turn's text is what the
    conversation through it adds to the conversation before it with the generation prompt."""
    render = lambda m, prompt: tokenizer.apply_chat_template(  # noqa: E731
        m, tokenize=False, add_generation_prompt=prompt)
    text = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:k], True), render(messages[:k + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise UsageError("the chat template of %s does not render a conversation as its "
                             "turns laid end to end, so its completion tokens cannot be told "
                             "apart; mark the assistant turns with {%% generation %%} or use "
                             "--train-on-prompt" % getattr(tokenizer, "name_or_path", "?"))
        spans.append((len(before), len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def encode(dataset, tokenizer, fmt, seq_len, packing, train_on_prompt, what="--data"):
    """The dataset's rows as {"input_ids", "labels"} rows of at most seq_len tokens: packed
    (text always), else each example truncated; rows with nothing to train are dropped."""
    encoder = Encoder(tokenizer, fmt, train_on_prompt)
    try:
        rows = dataset.map(encoder, remove_columns=dataset.column_names, desc="tokenizing")
    except UsageError:
        raise
    except (KeyError, TypeError) as e:
        raise UsageError("%s: a row does not have the fields of the %s format (%s: %s)"
                         % (what, fmt, type(e).__name__, e)) from None
    if packing or fmt == "text":
        rows = rows.map(lambda batch: pack(batch, seq_len), batched=True, desc="packing")
    else:
        rows = rows.map(lambda r: {k: v[:seq_len] for k, v in r.items()}, desc="truncating")
    rows = rows.filter(lambda r: any(x != IGNORE for x in r["labels"][1:]),
                       desc="dropping rows with nothing to train")
    if len(rows) == 0:
        raise UsageError("%s: no row has a token to train on (every label is -100)" % what)
    return rows


def pack(batch, seq_len):
    """Rows laid end to end and cut every seq_len tokens (the last piece kept, shorter)."""
    ids = [t for row in batch["input_ids"] for t in row]
    labels = [t for row in batch["labels"] for t in row]
    cuts = range(0, len(ids), seq_len)
    return {"input_ids": [ids[i:i + seq_len] for i in cuts],
            "labels": [labels[i:i + seq_len] for i in cuts]}


class Batches:
    """The micro-batches of one process: each epoch a permutation of the rows from the seed (a
    generator of its own, not torch's global one), cut into global micro-batches of
    micro_batch x world rows, of which this rank takes its slice. Its position (epoch, index)
    is its state, saved with each checkpoint, so a resumed run reads the same rows next."""

    def __init__(self, rows, micro_batch, seed, rank=0, world=1, pad_id=0):
        self.rows, self.micro_batch, self.seed = rows, micro_batch, seed
        self.rank, self.world, self.pad_id = rank, world, pad_id
        self.per_epoch = len(rows) // (micro_batch * world)
        if self.per_epoch == 0:
            raise UsageError("%d training rows are fewer than one micro-batch of %d rows x %d "
                             "processes: lower --micro-batch or give more data"
                             % (len(rows), micro_batch, world))
        self.epoch, self.index, self._order = 0, 0, None

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index, self._order = state["epoch"], state["index"], None

    def _permutation(self):
        import torch
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next(self):
        """The next micro-batch: {"input_ids", "labels", "attention_mask"} tensors, padded on the
        right to its longest row."""
        if self.index == self.per_epoch:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._permutation()
        start = (self.index * self.world + self.rank) * self.micro_batch
        picked = self.rows[self._order[start:start + self.micro_batch]]
        self.index += 1
        return collate(picked["input_ids"], picked["labels"], self.pad_id)


def collate(ids, labels, pad_id):
    import torch
    width = max(len(r) for r in ids)
    out = {"input_ids": torch.full((len(ids), width), pad_id, dtype=torch.long),
           "labels": torch.full((len(ids), width), IGNORE, dtype=torch.long),
           "attention_mask": torch.zeros((len(ids), width), dtype=torch.long)}
    for k, (i, l) in enumerate(zip(ids, labels)):
        out["input_ids"][k, :len(i)] = torch.tensor(i)
        out["labels"][k, :len(l)] = torch.tensor(l)
        out["attention_mask"][k, :len(i)] = 1
    return out


def all_batches(rows, micro_batch, pad_id):
    """Every row once, in order, in micro-batches (evaluation)."""
    for start in range(0, len(rows), micro_batch):
        picked = rows[start:start + micro_batch]
        yield collate(picked["input_ids"], picked["labels"], pad_id)
