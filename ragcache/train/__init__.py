"""Training utilities: link adapters, fragment tokenization and FIM/EFIM fine-tuning, and the infilling eval.

link      a read-side LoRA that keeps the base model's answers under a cheap link
fragment  fragment tokenization; FIM / EFIM training examples (input ids + labels)
infill    the fine-tuning loop (full or LoRA), saving a directory RagCache.open loads
tasks     infilling tasks cut from real Python sources (cursor inside a word)
evaluate  exact match / syntax pass, PSM against EFIM, through rc.infill
cli       `ragcache train link`, `ragcache train infill` and `ragcache train eval`
"""
