import itertools
import math
import random

import pytest

from daftrain.auto.allocation import (
    AllocationError,
    Choice,
    NoiseProfile,
    budget_for_avg_bits,
    choices_for,
    lower_hull,
    solve,
    solve_for_variance,
)
from daftrain.errors import InvalidArgumentError
from daftrain.layout import PackedLayout


def brute_force(items, budget):
    best = math.inf
    for picks in itertools.product(*(range(len(c)) for c in items)):
        if sum(items[i][p].nbytes for i, p in enumerate(picks)) <= budget:
            best = min(best, math.fsum(items[i][p].variance for i, p in enumerate(picks)))
    return best


def fewest_bytes(items, max_variance):
    best = math.inf
    for picks in itertools.product(*(range(len(c)) for c in items)):
        if math.fsum(items[i][p].variance for i, p in enumerate(picks)) <= max_variance:
            best = min(best, sum(items[i][p].nbytes for i, p in enumerate(picks)))
    return best


def random_items(rng, n):
    items = []
    for _ in range(n):
        numel = rng.choice([4096, 5000, 8192, 20000, 65536])
        noise = NoiseProfile(rng.uniform(0, 1e4) * numel, rng.choice([0.0, rng.uniform(0, 1e4) * numel]))
        items.append(choices_for(numel, rng.choice([2, 4]), rng.choice([64, 256]), noise, rng.lognormvariate(0, 2)))
    return items


def test_choices_follow_the_real_layout_and_the_noise_model():
    noise = NoiseProfile(plain_r2=600.0, zero_r2=0.0)
    choices = choices_for(10_000, 4, 256, noise, sensitivity=2.0)
    assert [c.bits for c in choices] == [1, 2, 4, 8, None]
    for c in choices[:-1]:
        assert c.nbytes == PackedLayout(c.bits, 256, 10_000).nbytes
        assert c.variance == pytest.approx(2.0 * 600.0 / (6 * (2**c.bits - 1) ** 2))
    assert (choices[-1].nbytes, choices[-1].variance) == (40_000, 0.0)


def test_integer_avg_bits_budget_is_exactly_the_fixed_width_bytes():
    numels = [4096, 5000, 123_457]
    for bits in (1, 2, 4, 8):
        assert budget_for_avg_bits(numels, bits, 256) == sum(PackedLayout(bits, 256, n).nbytes for n in numels)


def test_lower_hull_drops_dominated_and_non_convex_choices():
    pts = [Choice(1, 10, 100.0), Choice(2, 20, 90.0), Choice(4, 30, 20.0), Choice(8, 40, 25.0), Choice(None, 50, 0.0)]
    # 2 lies above the 1-4 segment (not convex); 8 is dominated by 4.
    assert lower_hull(pts) == [0, 2, 4]


def test_greedy_is_optimal_at_every_lagrangian_breakpoint():
    rng = random.Random(0)
    for _ in range(40):
        items = random_items(rng, rng.randint(2, 4))
        for lam in [0.0, *(10 ** rng.uniform(-6, 6) for _ in range(6))]:
            picks = [min(range(len(c)), key=lambda k, c=c: (c[k].variance + lam * c[k].nbytes, k)) for c in items]
            budget = sum(c[p].nbytes for c, p in zip(items, picks, strict=True))
            solution = solve(items, budget)
            assert solution.nbytes <= budget
            assert solution.variance == pytest.approx(brute_force(items, budget), rel=1e-12, abs=1e-12)


def test_greedy_is_within_its_bound_of_the_optimum_for_any_budget():
    rng = random.Random(1)
    for _ in range(60):
        items = random_items(rng, rng.randint(2, 4))
        lo = sum(min(c.nbytes for c in cs) for cs in items)
        hi = sum(max(c.nbytes for c in cs) for cs in items)
        budget = rng.randint(lo, hi)
        solution = solve(items, budget)
        opt = brute_force(items, budget)
        assert solution.nbytes <= budget
        assert opt - 1e-9 * abs(opt) <= solution.variance <= opt + solution.skipped_gain + 1e-9 * abs(opt)
        if solution.skipped_gain == 0.0:
            assert solution.variance == pytest.approx(opt, rel=1e-12, abs=1e-12)


def test_greedy_is_not_optimal_in_general():
    # The counterexample of NOTE [ Greedy allocation and when it is optimal ].
    items = [
        (Choice(1, 0, 100.0), Choice(2, 10, 0.0)),
        (Choice(1, 0, 85.0), Choice(2, 9, 0.0)),
        (Choice(1, 0, 19.9), Choice(2, 2, 0.0)),
    ]
    solution = solve(items, 11)
    assert solution.picks == (1, 0, 0)
    assert solution.variance == pytest.approx(104.9)
    assert brute_force(items, 11) == pytest.approx(100.0)
    assert solution.variance <= 100.0 + solution.skipped_gain


def test_solution_is_deterministic_and_ties_break_on_index():
    same = choices_for(8192, 4, 256, NoiseProfile(1e6, 0.0), 1.0)
    items = [same, same, same]
    budget = 2 * same[1].nbytes + same[0].nbytes  # room to raise exactly two of three to 2 bits
    first = solve(items, budget)
    assert first.picks == (1, 1, 0)
    assert all(solve(items, budget) == first for _ in range(3))


def test_a_budget_below_one_bit_everywhere_is_refused():
    items = [choices_for(8192, 4, 256, NoiseProfile(1.0, 0.0), 1.0)]
    with pytest.raises(AllocationError, match=r"below the .* bytes the saved tensors take at their fewest bits"):
        solve(items, items[0][0].nbytes - 1)


def test_a_large_budget_keeps_everything_exact():
    items = random_items(random.Random(2), 3)
    solution = solve(items, 10**12)
    assert all(c[p].bits is None for c, p in zip(items, solution.picks, strict=True))
    assert solution.variance == 0.0


def test_variance_bound_is_met_with_the_fewest_bytes_up_to_one_upgrade():
    # NOTE [ Fewest bytes under a variance bound ]: the walk's previous point is optimal for its bytes and
    # misses the bound, so the optimum costs more than that point; the answer costs one upgrade more.
    rng = random.Random(3)
    for _ in range(60):
        items = random_items(rng, rng.randint(2, 4))
        worst = math.fsum(min(c.variance for c in cs[:-1]) for cs in items)  # least variance short of exact
        bound = worst * 10 ** rng.uniform(-4, 0.5)
        solution = solve_for_variance(items, bound)
        assert solution.variance <= bound * (1 + 1e-12)
        opt = fewest_bytes(items, bound)
        assert opt <= solution.nbytes
        hulls = [lower_hull(c) for c in items]
        largest_upgrade = max(c[h[k + 1]].nbytes - c[h[k]].nbytes for c, h in zip(items, hulls, strict=True)
                              for k in range(len(h) - 1))
        assert solution.nbytes <= opt + largest_upgrade
        # at every breakpoint of the walk, the bytes are the fewest for that variance
        if solution.variance > 0:
            assert fewest_bytes(items, solution.variance) == solution.nbytes


def test_variance_bound_at_or_above_the_cheapest_choices_takes_them():
    items = random_items(random.Random(4), 3)
    cheapest = math.fsum(c[lower_hull(c)[0]].variance for c in items)
    solution = solve_for_variance(items, cheapest)
    assert solution.picks == tuple(lower_hull(c)[0] for c in items)
    assert solve_for_variance(items, 0.0).variance == 0.0  # exact everywhere


def test_a_negative_variance_bound_is_refused():
    with pytest.raises(InvalidArgumentError, match="max_variance"):
        solve_for_variance([choices_for(8192, 4, 256, NoiseProfile(1.0, 0.0), 1.0)], -1.0)


def test_variance_bound_survives_a_choice_of_astronomical_variance():
    # An attention mask of finfo.min saved by torch.max has a group range near 1e38: its variance dwarfs
    # the rest, and subtracting it from a running sum leaves a rounding residue far above any bound, which
    # would drive every other tensor to exact.
    huge = choices_for(8192, 4, 256, NoiseProfile(1e81, 0.0), 1.0)
    small = choices_for(8192, 4, 256, NoiseProfile(1e4, 0.0), 1.0)
    items = [huge, small, small]
    bound = 2 * small[1].variance  # the small ones fit at 2 bits
    solution = solve_for_variance(items, bound)
    assert items[0][solution.picks[0]].bits is None
    assert [items[i][solution.picks[i]].bits for i in (1, 2)] == [2, 2]
    assert solution.variance <= bound
