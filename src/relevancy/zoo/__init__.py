"""Models to explain (loaded by name in `relevancy.models`): packaged real models (SmolLM2, Gemma 3, DINOv2) and the
shipped text classifier (`zoo.text`)."""
