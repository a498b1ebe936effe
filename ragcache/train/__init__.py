"""Training utilities: fragment tokenization and FIM/EFIM fine-tuning, and the infilling eval.

fragment  fragment tokenization; FIM / EFIM training examples (input ids + labels)
infill    the fine-tuning loop (full or LoRA), saving a directory RagCache.open loads
tasks     infilling tasks cut from real Python sources (cursor inside a word)
evaluate  exact match / syntax pass, PSM against EFIM, through rc.infill
cli       `ragcache train infill` and `ragcache train eval`
"""
