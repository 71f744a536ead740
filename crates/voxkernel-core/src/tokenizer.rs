//! The Qwen2 byte-level BPE text tokenizer, built from `vocab.json` + `merges.txt` +
//! `tokenizer_config.json` (the released repositories ship no `tokenizer.json`).
