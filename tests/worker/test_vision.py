"""The projector's path as a pure function of the figures (issue 12): beside the weights when
both fit the budget, else swapped with them, unless the backend cannot swap."""

from __future__ import annotations

from arbiterd.worker.vision import EncoderPath, EncoderPlan, plan_encoder

MiB = 1 << 20


def test_a_projector_that_fits_beside_the_model_goes_beside() -> None:
    plan = plan_encoder(resident_bytes=6 * MiB, encoder_bytes=MiB, budget_bytes=7 * MiB)
    assert plan == EncoderPlan(EncoderPath.BESIDE)


def test_a_projector_that_does_not_fit_swaps_with_the_weights_and_says_why() -> None:
    plan = plan_encoder(resident_bytes=6 * MiB, encoder_bytes=MiB, budget_bytes=7 * MiB - 1)
    assert plan.path is EncoderPath.SWAP
    assert plan.reason == (
        "the model's 6.0 MiB and the projector's 1.0 MiB exceed the budget of 7.0 MiB: "
        "the weights left the device while it encoded"
    )


def test_without_a_budget_the_projector_goes_beside() -> None:
    plan = plan_encoder(resident_bytes=60 * MiB, encoder_bytes=60 * MiB, budget_bytes=0)
    assert plan == EncoderPlan(EncoderPath.BESIDE)


def test_a_backend_that_cannot_swap_goes_beside_and_says_so() -> None:
    plan = plan_encoder(
        resident_bytes=6 * MiB,
        encoder_bytes=2 * MiB,
        budget_bytes=7 * MiB,
        swap_refusal="it cannot",
    )
    assert plan.path is EncoderPath.BESIDE
    assert plan.reason.endswith("exceed the budget of 7.0 MiB, but it cannot: loaded beside")


def test_a_loaded_projector_adds_nothing() -> None:
    # a resident projector is in the model's bytes already: nothing more comes onto the device
    plan = plan_encoder(resident_bytes=7 * MiB, encoder_bytes=0, budget_bytes=7 * MiB)
    assert plan.path is EncoderPath.BESIDE
