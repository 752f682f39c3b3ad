"""``python -m llmtrain.prepare [MODEL AND DATA OVERRIDES] out=DIR``: tokenize a text corpus once
into a token folder on disk, read block by block: for corpora larger than memory. ``out=s3://BUCKET/PREFIX``
writes it to object storage (``llmtrain[s3]``; see docs/object-storage.md).

The overrides are those of ``python -m llmtrain`` (``model=...`` picks the tokenizer, ``data=...``
and ``data.*`` the text source; ``data.num_proc=N`` tokenizes in N processes). Train on the
result with ``data.format=tokens data.path=DIR`` (and the same model): the samples are the same
blocks ``data.format=text`` makes from the raw text, read without loading the corpus into memory.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    from llmtrain.config.compose import compose
    from llmtrain.config.validate import validate_data
    from llmtrain.data import MANIFEST, remote, text_documents, write_token_folder
    from llmtrain.common.errors import ConfigError, LlmtrainError
    from llmtrain.models.build import build_tokenizer
    from llmtrain.planning.preflight import preflight_data

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    outs = [a for a in args if a.startswith("out=")]
    overrides = [a for a in args if not a.startswith("out=")]
    try:
        if len(outs) != 1 or not outs[0][4:]:
            raise ConfigError("give the output folder once, as out=DIR")
        url = outs[0][4:] if remote.is_url(outs[0][4:]) else None
        out = url or Path(outs[0][4:]).expanduser()
        if url is not None:
            remote.refuse_unsupported(url, "out")
        elif out.exists() and not out.is_dir():
            raise ConfigError(f"out={out} is a file; give a folder to create")
        elif out.exists() and any(out.iterdir()):
            raise ConfigError(f"out={out} exists and is not empty; choose a new folder (nothing is overwritten)")
        cfg = compose(overrides)
        validate_data(cfg.data)
        preflight_data(cfg.data)
        if cfg.data.datasets or cfg.data.format != "text":
            raise ConfigError(f"llmtrain.prepare tokenizes one format=text source (got data.format={cfg.data.format}"
                              f"{', a mixture' if cfg.data.datasets else ''}); instruction and chat data are "
                              "cached on first use instead")
        if url is not None:
            remote.check_empty_prefix(url, "out")
        tokenizer = build_tokenizer(cfg.model)
        started, cpu = time.perf_counter(), time.process_time()
        documents = text_documents(remote.localized(cfg.data, "data"), "data")
        source = str(cfg.data.path) if cfg.data.path is not None else "python stdlib"
        if url is None:
            manifest = write_token_folder(documents, tokenizer, out, cfg.data.num_proc, source=source)
        else:  # written here, then uploaded with the manifest last (a reader finds it only when whole)
            with tempfile.TemporaryDirectory(prefix="llmtrain-prepare-") as staging:
                manifest = write_token_folder(documents, tokenizer, Path(staging) / "tokens", cfg.data.num_proc,
                                              source=source)
                remote.upload_folder(Path(staging) / "tokens", url, "out", last=MANIFEST)
    except LlmtrainError as err:  # ConfigError, DataError, ModelSourceError, MissingExtra (out=s3:// without s3fs)
        print(f"llmtrain.prepare: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra's own override errors
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            print(f"llmtrain.prepare: error: {err}", file=sys.stderr)
            return 2
        raise
    seconds = time.perf_counter() - started
    print(f"prepared {manifest['num_tokens']:,} tokens from {manifest['num_documents']:,} documents "
          f"({manifest['source']}) with {manifest['tokenizer'] or 'the tokenizer'} into {out} in {seconds:.1f} s "
          f"({manifest['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s, {time.process_time() - cpu:.1f} s CPU in "
          f"this process, num_proc={cfg.data.num_proc}); train with: data.format=tokens data.path={out}")
    return 0


if __name__ == "__main__":
    from llmtrain.common.interrupt import one_line_on_ctrl_c

    with one_line_on_ctrl_c("llmtrain.prepare"):  # its imports are inside main()
        sys.exit(main())
