"""Base models: where a served model comes from and what it reads.

- `loading`: a model located (local folder, Hugging Face cache or hub) and loaded, its device
  and dtype; `embedded` (+ `embedded_text/`): the offline default model, built locally;
- `vision`, `image_decodes`: a vision-language model's images, sized from their headers, held
  as sent and processed on a bounded pool shortly before their pass or prefill.

May import only the ground floor (errors, faults).
"""
