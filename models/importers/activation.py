"""The output activation of a bare TorchScript / ONNX network: given, or probed from its outputs.

A network file does not say whether it answers logits or probabilities. :func:`choose_activation`
looks at the outputs of a few runs on random inputs (``(1, C, *S)``, standard normal, three seeds):

- every value in [0, 1] and, with ``C > 1``, the channels summing to 1 (within 1e-3) at every
  voxel: a softmax is already applied inside the network -> ``none`` (outputs are probabilities);
- every value in [0, 1] otherwise: a sigmoid (or another squashing) is already applied -> ``none``;
- any value outside [0, 1]: raw logits -> ``softmax`` over the channels when ``C > 1``, ``sigmoid``
  when ``C == 1`` (the usual heads; ``--activation`` says otherwise).

A given ``--activation`` is checked against the same figures: ``none`` on logits is kept (the model
card then says the output is raw network values, not probabilities), ``softmax`` or ``sigmoid`` on
outputs already in [0, 1] is refused (it would squash probabilities a second time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.errors import ImportRefusedError

__all__ = ["ACTIVATIONS", "ActivationChoice", "choose_activation"]

#: The activations ``import-model --activation`` takes.
ACTIVATIONS = ("softmax", "sigmoid", "none")


@dataclass(frozen=True, slots=True)
class ActivationChoice:
    """What :func:`choose_activation` decided.

    Attributes:
        activation: ``softmax``, ``sigmoid`` or ``none`` (the spec's ``output.activation``).
        probabilities: whether the served ``probabilities`` output holds probabilities (``False``:
            raw network values, i.e. ``none`` on logits).
        reason: one sentence for the spec's comment and description (what was measured, what chosen).
    """

    activation: str
    probabilities: bool
    reason: str


def choose_activation(outputs: Sequence[np.ndarray], given: str | None, name: str) -> ActivationChoice:
    """The activation for a network whose outputs on random inputs are ``outputs``.

    Args:
        outputs: network outputs ``(1, C, *S)`` (at least one).
        given: ``--activation`` (``softmax``, ``sigmoid``, ``none``), or ``None`` to choose.
        name: model name for messages.

    Raises:
        ImportRefusedError: ``given`` is not one of :data:`ACTIVATIONS`, or squashes outputs that
            are already probabilities.
    """
    if given is not None and given not in ACTIVATIONS:
        raise ImportRefusedError(f"{name}: --activation {given!r} is not one of {list(ACTIVATIONS)}")
    channels = int(outputs[0].shape[1])
    low = min(float(np.min(y)) for y in outputs)
    high = max(float(np.max(y)) for y in outputs)
    unit = low >= 0.0 and high <= 1.0
    sums = max(float(np.abs(y.sum(axis=1) - 1.0).max()) for y in outputs)
    seen = f"outputs on random inputs from {low:.3g} to {high:.3g}"
    if unit and channels > 1 and sums <= 1e-3:
        found = "none"
        measured = f"{seen}, summing to 1 over the {channels} channels: softmax already applied"
    elif unit:
        found, measured = "none", f"{seen}: already probabilities (a sigmoid inside the network)"
    else:
        found = "softmax" if channels > 1 else "sigmoid"
        measured = f"{seen}: raw logits"
    if given is None:
        activation = found
        how = f"{activation} chosen" if found != "none" else "no activation added"
        other = " (--activation none keeps the raw outputs)" if found != "none" else ""
        reason = f"{measured}; {how}{other}"
    else:
        if unit and given != "none":
            raise ImportRefusedError(
                f"{name}: --activation {given} on outputs already in [0, 1] ({measured}) would squash "
                "probabilities twice; use --activation none"
            )
        activation = given
        reason = f"{measured}; --activation {given} given"
    probabilities = unit or activation != "none"
    if not probabilities:
        reason += ": the 'probabilities' output holds raw network values (logits), not probabilities"
    return ActivationChoice(activation, probabilities, reason)
