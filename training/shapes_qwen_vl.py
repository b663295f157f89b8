"""Train (or evaluate) the shapes Qwen2.5-VL: the shapes LLaVA's training (:mod:`training.shapes_vlm`: fresh scenes,
multi-turn conversations, ``--task-weights``, ``--mirror``, the loss on the answers only) for a
``transformers.Qwen2_5_VLForConditionalGeneration`` (:data:`relevancy.worlds.shapes_vlm.QWEN_VL_CONFIG`).

    python -m training.shapes_qwen_vl --train-tower [--seed S] [--minutes M | --steps N] [--init WEIGHTS]
                                      [--task-weights describe=2,relation=3] [--mirror]
    python -m training.shapes_qwen_vl --evaluate-only [--weights PATH] [--n 1000]

Model: started from the shipped shapes LLaVA (:func:`relevancy.worlds.shapes_vlm.qwen_vl_from_llava`): its decoder
exactly (the queries', keys' and values' biases zero), its CLIP tower carried over approximately into the windowed
Qwen2.5-VL tower (no position embeddings there: 2-D RoPE), the 2 x 2 patch merger new; ``--train-tower`` trains the
tower with the rest (as the tower is only approximately the CLIP's, the shipped run does).  Log
``shapes_qwen_vl_train.log`` beside the weights; seeds, schedule and validation as :mod:`training.shapes_vlm`'s.
"""

from __future__ import annotations

from functools import partial

from relevancy.worlds.shapes_vlm import QWEN_VL_CONFIG, QWEN_VL_WEIGHTS_PATH, build_shapes_qwen_vl, load_shapes_qwen_vl

from . import shapes_vlm

QWEN_VL = shapes_vlm.Recipe(QWEN_VL_CONFIG, QWEN_VL_WEIGHTS_PATH, "shapes_qwen_vl_train.log",
                            partial(build_shapes_qwen_vl, from_llava=True), lambda model: model.model.visual,
                            load_shapes_qwen_vl, "the shapes LLaVA's CLIP tower, carried over")


def main(argv=None) -> None:
    shapes_vlm.main(argv, QWEN_VL, __doc__, lr=5e-4)


if __name__ == "__main__":
    main()
