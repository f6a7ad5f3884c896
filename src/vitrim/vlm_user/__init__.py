"""A user's own vision-language model and picture: load a checkpoint folder or hub id, ask a question with a
method of :mod:`vitrim.vlm` applied, and record which image tokens entered the LLM (``vitrim vlm ask --model``).

::

    model, processor = load_vlm("llava-hf/llava-1.5-7b-hf")        # a folder, or a hub id from the local cache
    answer = ask(model, processor, Image.open("cat.png"), "What is on the mat?", method="visionzip", keep=64)
    answer.text, answer.entered, answer.total                         # the reply; image tokens in the LLM / unpruned
    answer.records()                                                  # per image: the selection, JSON-ready

The picture of the kept tokens on the user's image is :func:`vitrim.viz.plot_vlm_kept`; :func:`save_tiny_vlm`
writes a tiny random checkpoint folder to try all this offline.
"""

from vitrim.moved import moved_names
from vitrim.vlm_user.ask import Answer, ask, save_answer
from vitrim.vlm_user.load import load_vlm
from vitrim.vlm_user.tiny import save_tiny_vlm

__getattr__ = moved_names(__name__)  # load_model, now load_vlm (one release)

__all__ = ["Answer", "ask", "load_vlm", "save_answer", "save_tiny_vlm"]
