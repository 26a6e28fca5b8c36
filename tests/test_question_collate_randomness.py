"""Random draws in a collate_fn and in DataLoader workers under DDP (examples/collate_randomness.py)."""

PLAIN = ("main", "main_seeded", "worker", "worker_seeded")
KEYED = ("keyed", "keyed_worker")


def test_plain_draws_repeat_across_ranks_unless_workers_are_seeded_per_rank(generated):
    r = generated("collate_randomness")
    assert r["main"]["draws_per_rank"] > 0
    for case in ("main", "main_seeded", "worker"):  # workers=True does nothing without workers
        assert r[case]["repeated_across_ranks"] == 1.0, case
    assert r["worker_seeded"]["repeated_across_ranks"] < 0.01  # Lightning's worker_init_fn mixes in the rank


def test_no_plain_draw_is_one_devices_and_the_first_gradient_differs(generated):
    r = generated("collate_randomness")
    for case in PLAIN:
        assert r[case]["same_as_one_device"] < 0.01, case
        assert r[case]["grad_rel_diff"] > 1e-2, case


def test_draws_keyed_to_the_sample_reproduce_one_device_with_and_without_workers(generated):
    r = generated("collate_randomness")
    for case in KEYED:
        assert r[case]["same_as_one_device"] == 1.0, case          # every draw, both epochs
        assert r[case]["repeated_across_ranks"] < 0.01, case       # ranks hold different samples
        assert r[case]["epoch1_same_as_epoch0"] < 0.01, case       # the epoch reached the collator (and workers)
        assert r[case]["grad_rel_diff"] < 1e-12, case              # float64 rounding
