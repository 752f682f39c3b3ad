"""Preference pairs: records -> pairs of token sequences, their truncation, packing and batching.

A *pair* is ``{"chosen_ids", "rejected_ids": list[int], "prompt_len": int}`` (and ``margin`` when
the data has one): both sequences are the same ``prompt_len`` prompt tokens followed by their
completion, and only completion tokens carry a loss. Layouts read (TRL's, by column mapping):

* explicit prompt: ``prompt``, ``chosen``, ``rejected`` as strings, or as message lists
  (``[{"role", "content"}]``; the prompt rendered with the chat template and its generation
  prompt, each completion as the conversation's continuation);
* implicit prompt: ``chosen`` and ``rejected`` only, the prompt being their shared prefix (strings:
  TRL's ``extract_prompt`` rule, as in Anthropic HH-RLHF; message lists: the shared leading turns).

Token ids follow TRL's ``DPOTrainer`` tokenization (``trl/trainer/dpo_trainer.py``,
``_prepare_dataset``): prompt and prompt+completion are tokenized separately and the completion
starts where the two diverge; string completions end with EOS. A micro-batch lays out ``m`` pairs
as ``2m`` rows, chosen rows first (TRL's concatenated forward), or, packed (``data.packing``),
several pairs per row with every sequence a document of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from llmtrain.data.formats import _apply_template, conversation
from llmtrain.data.order import pack
from llmtrain.data.sources import column, record_errors
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.images import image_token_id, processor_of
from llmtrain.common.labels import IGNORE_INDEX


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen completion, rejected completion) of an implicit-prompt pair: the longest
    shared prefix of two strings (a space before the first differing character goes to the
    completions) or of two message lists, as TRL's ``data_utils.extract_prompt``."""
    idx = 0
    # TRL's loop exactly, including its end: when one is a prefix of the other, the prompt stops
    # one element short of it (the loop variable's last value).
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Continuations:
    """Tokenization shared by pairs and unpaired examples (:meth:`continuations`)."""

    def __init__(self, data_cfg: Any, tokenizer: Any, where: str):
        self.tokenizer, self.where, self.data_cfg = tokenizer, where, data_cfg
        self.eos = tokenizer.eos_token_id
        self._chat_checked = False

    def continuations(self, prompt: Any, completions: list[Any], at: str,
                      names: tuple[str, list[str]] = ("prompt", ["completion"]),
                      images: tuple[str, list] | None = None) -> tuple[list[int], list[list[int]]]:
        """(prompt ids, completion ids of each) of a prompt and its completions, all strings or all
        message lists; ``names``: the columns they come from (for error messages). The
        completion starts where prompt and prompt+completion diverge (tokens may merge across the
        boundary), as TRL does; string completions end with EOS. ``images``: (the images column,
        the record's image paths) of an image-text record, whose message lists are rendered and
        expanded by the processor (:func:`llmtrain.data.vision.image_conversations_ids`)."""
        if images is not None:
            from llmtrain.data.vision import image_conversations_ids

            prompt_ids, *fulls = image_conversations_ids(self.tokenizer, prompt, completions, names, images, at)
        elif isinstance(prompt, list):
            if not self._chat_checked:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ConfigError(f"{at}: message lists are rendered with a chat template, and this tokenizer has "
                                      "none; set data.template=chatml (the built-in ChatML template) or "
                                      "data.template=/path/to/template.jinja")
                self._chat_checked = True
            if not prompt:
                raise DataError(f"{at}: field {names[0]!r} has no turns; a preference record needs at least one prompt "
                                "turn")
            turns = conversation({names[0]: prompt}, names[0], "messages", f"{at} field {names[0]!r}")

            def ids(messages: list[dict], generation_prompt: bool = False) -> list[int]:
                return list(_apply_template(self.tokenizer, messages, at, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt)["input_ids"])
            prompt_ids = ids(turns, generation_prompt=True)
            fulls = [ids(turns + conversation({name: c}, name, "messages", f"{at} field {name!r}"))
                     for name, c in zip(names[1], completions)]
        else:
            tok = self.tokenizer
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            fulls = [tok(prompt + c, add_special_tokens=False)["input_ids"] + [self.eos] for c in completions]
        n = min(_common_prefix(prompt_ids, full) for full in fulls)
        return prompt_ids[:n], [full[n:] for full in fulls]


class PairEncoder(_Continuations):
    """Tokenizes one record into (prompt ids, chosen completion ids, rejected completion ids).

    Raises (per record, naming ``where``, the record and the field):
        DataError: a field of the wrong type, a message list that is not role/content turns,
            chosen identical to rejected, or an implicit-prompt pair with no shared prefix.
    """

    def __init__(self, records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str):
        from llmtrain.config.schema import mapped_columns

        super().__init__(data_cfg, tokenizer, where)
        self.chosen = column(records, src, "chosen", key, "preference", where)
        self.rejected = column(records, src, "rejected", key, "preference", where)
        mapped = mapped_columns(src.columns)
        self.prompt = (column(records, src, "prompt", key, "preference", where)
                       if "prompt" in mapped or "prompt" in records.column_names else None)
        self.margin = (column(records, src, "margin", key, "preference", where)
                       if "margin" in mapped or "margin" in records.column_names else None)
        from llmtrain.data.vision import images_column

        self.images = images_column(records, src)  # TRL's VLM layout: the prompt's image paths
        path = Path(str(src.path)).expanduser()
        self.base = path if path.is_dir() else path.parent  # relative image paths: next to the data file
        processor = processor_of(tokenizer)
        # The image token of an image-text model reading an images column, else None (text pairs).
        self.image_token_id = image_token_id(processor) if processor is not None and self.images else None

    def paths(self, rec: dict, i: int) -> list[Path]:
        """The record's image paths (relative ones under the data file's folder); [] without an
        images column.

        Raises:
            DataError: not a list of paths, or images for a text-only model (naming the record).
        """
        if self.images is None:
            return []
        from llmtrain.data.vision import image_paths

        at = f"{self.where} record {i}"
        paths = image_paths(rec.get(self.images), self.base, at, self.images)
        if paths and self.image_token_id is None:
            raise DataError(f"{at}: field {self.images!r} holds {len(paths)} image(s), and the model is text-only (no "
                            "image processor); use an image-text model (e.g. model=tiny_idefics3) or drop the images")
        return paths

    def __call__(self, rec: dict, i: int) -> tuple[list[int], list[int], list[int]]:
        at = f"{self.where} record {i}"
        chosen, rejected = rec[self.chosen], rec[self.rejected]
        prompt = rec[self.prompt] if self.prompt is not None else None
        conversational = isinstance(chosen, list)
        for name, value in (("chosen", chosen), ("rejected", rejected)) + ((("prompt", prompt),) if self.prompt else ()):
            if value is None:
                raise DataError(f"{at}: field {self._col(name)!r} is missing (null)")
            if not isinstance(value, (str, list)) or isinstance(value, list) != conversational:
                raise DataError(f"{at}: field {self._col(name)!r} is a {type(value).__name__}, field {self.chosen!r} a "
                                f"{type(chosen).__name__}: a pair's fields must all be strings or all message lists")
        if chosen == rejected:
            raise DataError(f"{at}: fields {self.chosen!r} and {self.rejected!r} are identical, so the pair prefers "
                            "nothing; remove the record or fix its rejected completion")
        if prompt is None:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            if not prompt:
                raise DataError(f"{at}: fields {self.chosen!r} and {self.rejected!r} share no prefix, so no prompt can "
                                "be taken from them (implicit-prompt layout); add a prompt column (data.columns.prompt="
                                "COLUMN) or check the two columns")
        paths = self.paths(rec, i)
        images = (self.images, paths) if self.image_token_id is not None else None
        prompt_ids, (c, r) = self.continuations(prompt, [chosen, rejected], at,
                                                (self.prompt or "prompt", [self.chosen, self.rejected]), images)
        return prompt_ids, c, r

    def _col(self, name: str) -> str:
        return {"chosen": self.chosen, "rejected": self.rejected, "prompt": self.prompt}[name]


def fit_example(prompt: list[int], completion: list[int], seq_len: int, max_prompt_tokens: int | None,
                drop_long: bool) -> tuple[dict | None, str]:
    """Truncate one prompt + completion to at most ``seq_len`` tokens: the prompt keeps its last
    ``max_prompt_tokens`` (when set), then the completion its first ``seq_len - len(prompt)``
    tokens (TRL's ``keep_start``).

    Returns:
        (``{"ids", "prompt_len"}`` or None when dropped, outcome): ``kept``, ``truncated``,
        ``dropped_too_long`` (``data.truncation=drop``) or ``dropped_truncated_away`` (no
        completion token left).
    """
    outcome = "kept"
    if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
        if drop_long:
            return None, "dropped_too_long"
        prompt, outcome = prompt[len(prompt) - max_prompt_tokens:], "truncated"
    room = seq_len - len(prompt)
    if len(prompt) + len(completion) > seq_len:
        if drop_long:
            return None, "dropped_too_long"
        completion, outcome = completion[:max(room, 0)], "truncated"
    if room <= 0 or not completion:
        return None, "dropped_truncated_away"
    return {"ids": prompt + completion, "prompt_len": len(prompt)}, outcome


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, max_prompt_tokens: int | None,
             drop_long: bool) -> tuple[dict | None, str]:
    """:func:`fit_example` for both completions of a pair (the same prompt cut for both).

    Returns:
        (``{"chosen_ids", "rejected_ids", "prompt_len"}`` or None, outcome): ``kept`` or
        ``truncated`` when either was cut; dropped when either is, or when the two completions
        became identical (``dropped_truncated_away``).
    """
    c, c_outcome = fit_example(prompt, chosen, seq_len, max_prompt_tokens, drop_long)
    r, r_outcome = fit_example(prompt, rejected, seq_len, max_prompt_tokens, drop_long)
    for outcome in ("dropped_too_long", "dropped_truncated_away"):
        if outcome in (c_outcome, r_outcome):
            return None, outcome
    if c["ids"] == r["ids"]:
        return None, "dropped_truncated_away"
    outcome = "truncated" if "truncated" in (c_outcome, r_outcome) else "kept"
    return {"chosen_ids": c["ids"], "rejected_ids": r["ids"], "prompt_len": c["prompt_len"]}, outcome


def encode_pairs(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str):
    """Encode every record of a preference source into pairs (see :func:`fit_pair`).

    Returns:
        (``datasets.Dataset`` with ``chosen_ids``, ``rejected_ids``, ``prompt_len`` and, with a
        margin column, ``margin``; counts ``{"records", "truncated", "dropped_too_long",
        "dropped_truncated_away", "dropped_no_target"}``).

    Raises:
        DataError: a malformed record (names file, record and field), or fewer than 2 pairs left.
    """
    encode = PairEncoder(records, src, data_cfg, tokenizer, key, where)
    seq_len, drop_long, max_prompt = data_cfg.seq_len, data_cfg.truncation == "drop", data_cfg.max_prompt_tokens

    image_id = encode.image_token_id

    def encode_batch(batch: dict, indices: list[int]) -> dict:
        out: dict[str, list] = {"chosen_ids": [], "rejected_ids": [], "prompt_len": [], "margin": [], "outcome": [],
                                "images": []}
        for values, i in zip(zip(*batch.values()), indices):
            rec = dict(zip(batch, values))
            prompt, chosen, rejected = encode(rec, i)
            pair, outcome = fit_pair(prompt, chosen, rejected, seq_len, max_prompt, drop_long)
            if pair is not None and image_id is not None and (
                    pair["chosen_ids"][:pair["prompt_len"]].count(image_id) != prompt.count(image_id)):
                pair, outcome = None, "dropped_too_long"  # a prompt cut through its image tokens
            images = [str(p) for p in encode.paths(rec, i)] if image_id is not None else []
            margin = rec.get(encode.margin) if encode.margin is not None else 0.0
            if not isinstance(margin, (int, float)) or isinstance(margin, bool):
                raise DataError(f"{where} record {i}: field {encode.margin!r} must be a number, got "
                                f"{type(margin).__name__}")
            pair = pair or {"chosen_ids": [], "rejected_ids": [], "prompt_len": 0}
            for name in ("chosen_ids", "rejected_ids", "prompt_len"):
                out[name].append(pair[name])
            out["margin"].append(float(margin))
            out["outcome"].append(outcome)
            out["images"].append(images)
        return out

    with record_errors(where):  # a record refused names its line; one not UTF-8 names its byte
        encoded = records.map(encode_batch, batched=True, with_indices=True, remove_columns=records.column_names,
                              num_proc=data_cfg.num_proc if 1 < data_cfg.num_proc <= len(records) // 2 else None,
                              desc=f"encode {src.name}")
    outcomes = encoded["outcome"]
    counts = {"records": len(records), "dropped_no_target": 0}
    for kind in ("truncated", "dropped_too_long", "dropped_truncated_away"):
        counts[kind] = outcomes.count(kind)
    keep = [i for i, o in enumerate(outcomes) if o in ("kept", "truncated")]
    pairs = encoded.select(keep).remove_columns(["outcome"] + ([] if encode.margin is not None else ["margin"])
                                                + ([] if image_id is not None else ["images"]))
    if len(pairs) < 2:
        dropped = counts["dropped_too_long"] + counts["dropped_truncated_away"]
        raise DataError(f"{where}: {len(pairs)} of {len(records)} preference records give a usable pair at "
                        f"data.seq_len={seq_len} (truncated {counts['truncated']}, dropped as too long "
                        f"{counts['dropped_too_long']}, left without a completion token {counts['dropped_truncated_away']})"
                        "; need at least 2" + ("; raise data.seq_len" if dropped else "; add records"))
    return pairs, counts


class ExampleEncoder(_Continuations):
    """Tokenizes one unpaired record (KTO's {prompt, completion, label}) into (prompt ids,
    completion ids, desirable).

    Raises (per record, naming ``where``, the record and the field):
        DataError: a missing field, a prompt and completion of different kinds, or a label that
            is not a boolean.
    """

    def __init__(self, records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str):
        super().__init__(data_cfg, tokenizer, where)
        self.fields = {f: column(records, src, f, key, "kto", where) for f in ("prompt", "completion", "label")}

    def __call__(self, rec: dict, i: int) -> tuple[list[int], list[int], bool]:
        at = f"{self.where} record {i}"
        prompt, completion, label = (rec[self.fields[f]] for f in ("prompt", "completion", "label"))
        for name, value in (("prompt", prompt), ("completion", completion)):
            if value is None:
                raise DataError(f"{at}: field {self.fields[name]!r} is missing (null)")
            if not isinstance(value, (str, list)) or isinstance(value, list) != isinstance(prompt, list):
                raise DataError(f"{at}: field {self.fields[name]!r} must be a string or a list of messages like "
                                f"the prompt, got {type(value).__name__}")
        if not isinstance(label, bool):
            raise DataError(f"{at}: field {self.fields['label']!r} must be a boolean (true: a desirable completion, "
                            f"false: an undesirable one), got {type(label).__name__} {label!r}")
        prompt_ids, (completion_ids,) = self.continuations(prompt, [completion], at,
                                                           (self.fields["prompt"], [self.fields["completion"]]))
        return prompt_ids, completion_ids, label


def encode_examples(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str, unpair: bool):
    """KTO's unpaired examples: of a ``kto`` source, or of a ``preference`` source with ``unpair``
    (each pair gives its chosen completion as a desirable example, then its rejected one as an
    undesirable example, as TRL's ``unpair_preference_dataset`` does). Truncated as pairs are
    (:func:`fit_example`); ``completion_ids`` keeps the whole completion (up to ``seq_len``
    tokens), which another example's KL sequence borrows before its own cut, as TRL does.

    Returns:
        (``datasets.Dataset`` with ``ids``, ``prompt_len``, ``label`` (1 desirable, 0 not),
        ``completion_ids``; counts of examples as :func:`encode_pairs`'s of pairs).

    Raises:
        DataError: a malformed record (names file, record and field), or fewer than 2 examples left.
    """
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    seq_len, drop_long, max_prompt = data_cfg.seq_len, data_cfg.truncation == "drop", data_cfg.max_prompt_tokens
    counts = {"records": len(records), "dropped_no_target": 0, "truncated": 0, "dropped_too_long": 0,
              "dropped_truncated_away": 0}
    # group: the record an example comes from, so a pair's two examples land on the same side of
    # the train/validation split (no held-out prompt seen in training).
    out: dict[str, list] = {"ids": [], "prompt_len": [], "label": [], "completion_ids": [], "group": []}
    encode = (PairEncoder if unpair else ExampleEncoder)(records, src, data_cfg, tokenizer, key, where)
    with record_errors(where):  # as encode_pairs's
        for i, rec in enumerate(records):
            if unpair:
                prompt, chosen, rejected = encode(rec, i)
                examples = [(prompt, chosen, True), (prompt, rejected, False)]
            else:
                examples = [encode(rec, i)]
            for prompt, completion, label in examples:
                fitted, outcome = fit_example(prompt, completion, seq_len, max_prompt, drop_long)
                if outcome in counts:
                    counts[outcome] += 1
                if fitted is not None:
                    out["ids"].append(fitted["ids"])
                    out["prompt_len"].append(fitted["prompt_len"])
                    out["label"].append(int(label))
                    out["completion_ids"].append(completion[:seq_len])
                    out["group"].append(i)
    if len(out["ids"]) < 2:
        raise DataError(f"{where}: {len(out['ids'])} examples left at data.seq_len={seq_len}; need at least 2")
    counts["examples_read"] = sum(counts[k] for k in ("dropped_too_long", "dropped_truncated_away")) + len(out["ids"])
    return datasets.Dataset.from_dict(out), counts


class PackedPairs(torch.utils.data.Dataset):
    """Pairs packed into rows: row ``k`` holds the pairs ``groups[k]`` (first fit in order, at most
    ``2 * seq_len`` tokens a row, as each sequence has at most ``seq_len``). An item is
    ``{"pairs": [pair, ...]}``."""

    def __init__(self, pairs: Any, seq_len: int):
        self.pairs = pairs
        lengths = [len(c) + len(r) for c, r in zip(pairs["chosen_ids"], pairs["rejected_ids"])]
        self.groups = pack(lengths, 2 * seq_len)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, k: int) -> dict:
        return {"pairs": [self.pairs[i] for i in self.groups[k]]}


class WithReference(torch.utils.data.Dataset):
    """A dataset whose pairs carry precomputed reference log-probs: item ``k``'s pairs get
    ``ref_chosen_logp`` and ``ref_rejected_logp`` from ``values[offsets[k]:offsets[k + 1]]``
    (float64 ``[pairs, 2]``, nats), in the order the item lists its pairs."""

    def __init__(self, base: Any, values: torch.Tensor, offsets: torch.Tensor):
        self.base, self.values, self.offsets = base, values, offsets

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, k: int) -> dict:
        item = self.base[k]
        pairs = item["pairs"] if "pairs" in item else [item]
        start = int(self.offsets[k])
        with_ref = [dict(p, ref_chosen_logp=float(self.values[start + j, 0]), ref_rejected_logp=float(
            self.values[start + j, 1])) for j, p in enumerate(pairs)]
        return {"pairs": with_ref} if "pairs" in item else with_ref[0]


def pairs_of(item: dict) -> list[dict]:
    """The pairs of one dataset item (a pair, or a packed row's pairs)."""
    return item["pairs"] if "pairs" in item else [item]


class PairCollator:
    """Lays out a micro-batch of pairs (or packed rows of pairs) for the model and the loss.

    Unpacked (items are pairs): ``2m`` rows for ``m`` pairs, the chosen sequences then the
    rejected ones, right-padded to the longest. Packed (items are ``{"pairs": [...]}``): one row
    per item, each sequence a document with positions restarting at 0 (``position_ids``).

    Returns int64 ``[rows, longest]`` tensors ``input_ids`` (padding ``pad_id``),
    ``attention_mask`` and ``labels`` (-100 on prompt tokens and padding), and:

    * ``segment``: int64, the sequence each token belongs to (prompt included), numbered in the
      micro-batch: pair ``j``'s chosen is ``2j``, its rejected ``2j + 1``; -1 on padding;
    * ``ref_logps`` (float32, when the pairs carry precomputed ones), ``margin`` and ``desirable``
      (float32, always; KTO's label): a per-sequence number placed on the sequence's first
      completion token, 0 elsewhere, so summing over a segment gives it back (rows split or
      padded keep it).

    KTO examples (items with a ``label``) are laid out as :meth:`_kto_rows` says.
    """

    def __init__(self, pad_id: int, seq_len: int | None = None, processor: Any = None):
        self.pad_id, self.seq_len, self.processor = pad_id, seq_len, processor

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        packed = "pairs" in items[0]
        if "label" in items[0]:
            rows = self._kto_rows(items)
        elif packed:
            rows, j = [], 0
            for item in items:
                row = []
                for pair in item["pairs"]:
                    row += [_sequence(pair, "chosen", 2 * j), _sequence(pair, "rejected", 2 * j + 1)]
                    j += 1
                rows.append(row)
        else:
            rows = ([[_sequence(p, "chosen", 2 * j)] for j, p in enumerate(items)]
                    + [[_sequence(p, "rejected", 2 * j + 1)] for j, p in enumerate(items)])
        has_ref = "ref_chosen_logp" in pairs_of(items[0])[0] or "ref_logp" in items[0]
        longest = max(sum(len(doc["ids"]) for doc in row) for row in rows)
        shape = (len(rows), longest)
        out = {"input_ids": torch.full(shape, self.pad_id, dtype=torch.long),
               "attention_mask": torch.zeros(shape, dtype=torch.long),
               "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
               "segment": torch.full(shape, -1, dtype=torch.long),
               "margin": torch.zeros(shape, dtype=torch.float32),
               "desirable": torch.zeros(shape, dtype=torch.float32)}
        if has_ref:
            out["ref_logps"] = torch.zeros(shape, dtype=torch.float64)  # sums of ~-500 nats: float32 rounds them
        if packed:
            out["position_ids"] = torch.zeros(shape, dtype=torch.long)
        for r, row in enumerate(rows):
            t = 0
            for doc in row:
                n, first = len(doc["ids"]), t + doc["prompt_len"]
                out["input_ids"][r, t:t + n] = torch.as_tensor(doc["ids"])
                out["attention_mask"][r, t:t + n] = 1
                out["labels"][r, first:t + n] = torch.as_tensor(doc["ids"][doc["prompt_len"]:])
                out["segment"][r, t:t + n] = doc["segment"]
                out["margin"][r, first] = doc["margin"]
                out["desirable"][r, first] = doc.get("desirable", 0.0)
                if has_ref:
                    out["ref_logps"][r, first] = doc["ref"]
                if packed:
                    out["position_ids"][r, t:t + n] = torch.arange(n)
                t += n
            if packed:
                out["position_ids"][r, t:] = torch.arange(longest - t)
        if self.processor is not None and not packed and "images" in items[0]:
            from llmtrain.data.vision import image_tensors

            # Both rows of a pair read its prompt's images: the chosen rows' images, then the rejected rows'.
            out.update(image_tensors(self.processor, [list(p["images"]) for p in items] * 2))
        return out


    def _kto_rows(self, examples: list[dict]) -> list[list[dict]]:
        """KTO: example ``j`` (segment ``2j``) and its KL sequence (segment ``2j + 1``): its prompt
        with the completion of example ``j - 1`` (cyclically) of the micro-batch, cut to
        ``seq_len``, the mismatched pairs of TRL's ``KTOTrainer`` (its KL estimate, Ethayarajh et
        al. 2024, section 4.1)."""
        m = len(examples)
        rows, kl_rows = [], []
        for j, ex in enumerate(examples):
            prev = examples[(j - 1) % m]
            kl_ids = (ex["ids"][:ex["prompt_len"]] + prev["completion_ids"])[:self.seq_len]
            rows.append([{"ids": ex["ids"], "prompt_len": ex["prompt_len"], "segment": 2 * j, "margin": 0.0,
                          "desirable": float(ex["label"]), "ref": ex.get("ref_logp", 0.0)}])
            kl_rows.append([{"ids": kl_ids, "prompt_len": ex["prompt_len"], "segment": 2 * j + 1, "margin": 0.0,
                             "ref": ex.get("ref_kl_logp", 0.0)}])
        return rows + kl_rows


def _sequence(pair: dict, which: str, segment: int) -> dict:
    return {"ids": pair[f"{which}_ids"], "prompt_len": pair["prompt_len"], "segment": segment,
            "margin": float(pair.get("margin", 0.0)) if which == "chosen" else 0.0,
            "ref": pair.get(f"ref_{which}_logp", 0.0)}
