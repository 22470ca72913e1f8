"""Admission, preemption and burst aggregation as decisions (no Ray): what a user of a shared
cluster would see happen to their jobs, case by case (issue #36's "Must show")."""

from __future__ import annotations

from tidal.admission.cloud import BurstRequest, CloudUse, aggregate_bursts
from tidal.admission.decision import QueuedJob, RunningJob
from tidal.admission.policy import decide
from tidal.admission.quotas import Quotas

GAP = 60.0  # min_resize_interval_s in these tests
QUOTAS = Quotas(min_resize_interval_s=GAP)


def running(job: str, workers: int, lo: int, hi: int, priority: str = "low", team: str = "default",
            last_resize: float = 0.0, **kw) -> RunningJob:
    return RunningJob(job, team, priority, lo, hi, workers, last_resize, **kw)


def queued(job: str, lo: int, hi: int, priority: str = "normal", team: str = "default", at: float = 100.0) -> QueuedJob:
    return QueuedJob(job, team, priority, lo, hi, at)


def teams(**shares: tuple[int, int]) -> Quotas:
    return Quotas.model_validate({
        "min_resize_interval_s": GAP, "defaults": {"team": next(iter(shares))},
        "teams": {t: {"onprem": {"guaranteed": g, "borrow": b}} for t, (g, b) in shares.items()}})


# --- a high-priority job arrives on a full cluster ---------------------------------------------

def test_high_job_shrinks_low_elastic_job_to_make_room():
    low = running("low", 4, 1, 4, "low")
    d = decide(4, [low], [queued("high", 2, 2, "high")], QUOTAS, now=1000.0)
    assert d.workers("low") == 2 and d.workers("high") == 2
    assert [a.job for a in d.admit] == ["high"] and not d.suspend and not d.waiting
    assert "high" in d.shrink[0].reason


def test_low_job_grows_back_when_the_high_one_ends():
    low = running("low", 2, 1, 4, "low", last_resize=1000.0)
    d = decide(4, [low], [], QUOTAS, now=1000.0 + GAP)
    assert [(g.job, g.workers) for g in d.grow] == [("low", 4)]


def test_no_job_is_resized_twice_within_the_minimum_interval():
    # shrunk 10 s ago: the freed slots wait until the interval has passed
    low = running("low", 2, 1, 4, "low", last_resize=1000.0)
    assert decide(4, [low], [], QUOTAS, now=1010.0).grow == ()
    # a high job needing room from a job resized 10 s ago waits, and is told until when
    d = decide(4, [running("low", 4, 1, 4, "low", last_resize=1000.0)], [queued("high", 2, 2, "high")],
               QUOTAS, now=1010.0)
    assert d.admit == () and d.shrink == ()
    (w,) = d.waiting
    assert (w.job, w.why, w.starts_at) == ("high", "resize_interval", 1000.0 + GAP)
    assert "'low'" in w.reason and "60s" in w.reason


def test_non_elastic_low_job_that_must_give_up_everything_is_suspended():
    rigid = running("rigid", 4, 4, 4, "low")
    d = decide(4, [rigid], [queued("high", 2, 2, "high")], QUOTAS, now=1000.0)
    assert [s.job for s in d.suspend] == ["rigid"] and d.workers("rigid") == 0
    assert d.workers("high") == 2 and d.shrink == ()
    assert "'high'" in d.suspend[0].reason


def test_shrinking_comes_before_suspending_and_takes_only_what_is_needed():
    jobs = [running("rigid", 2, 2, 2, "low"), running("elastic", 4, 2, 4, "low")]
    d = decide(6, jobs, [queued("high", 2, 2, "high")], QUOTAS, now=1000.0)
    assert d.suspend == () and d.workers("elastic") == 2 and d.workers("high") == 2


def test_equal_priority_never_preempts_and_waits_for_capacity_with_an_estimate():
    busy = running("busy", 4, 2, 4, "normal", expected_end=1500.0)
    d = decide(4, [busy], [queued("next", 2, 2, "normal")], QUOTAS, now=1000.0)
    assert d.admit == () and d.shrink == ()
    (w,) = d.waiting
    assert (w.why, w.position, w.starts_at) == ("capacity", 1, 1500.0)


def test_jobs_behind_a_waiting_urgent_job_wait_for_it_and_say_so():
    busy = running("busy", 3, 3, 3, "high")
    d = decide(4, [busy], [queued("big", 2, 2, "normal", at=1.0), queued("small", 1, 1, "low", at=2.0)],
               QUOTAS, now=1000.0)
    assert d.admit == ()
    assert [(w.job, w.position, w.why) for w in d.waiting] == [("big", 1, "capacity"), ("small", 2, "priority")]
    assert "'big'" in d.waiting[1].reason


def test_queue_order_is_priority_then_submission():
    d = decide(1, [], [queued("early-low", 1, 1, "low", at=1.0), queued("late-high", 1, 1, "high", at=5.0)],
               QUOTAS, now=1000.0)
    assert [a.job for a in d.admit] == ["late-high"]
    assert d.waiting[0].job == "early-low"


# --- team quotas and borrowing -------------------------------------------------------------------

def test_team_at_its_quota_queues_its_next_job_naming_team_and_quota_then_admits_it():
    quotas = teams(vision=(2, 0), nlp=(2, 0))
    first = running("v1", 2, 2, 2, "normal", team="vision")
    d = decide(8, [first], [queued("v2", 2, 2, "normal", team="vision")], quotas, now=1000.0)
    assert d.admit == ()
    (w,) = d.waiting
    assert w.why == "quota" and "'vision'" in w.reason and "2 of 2" in w.reason and "guaranteed 2" in w.reason
    assert w.position == 1
    # its running job ends: the next one is admitted
    d = decide(8, [], [queued("v2", 2, 2, "normal", team="vision")], quotas, now=1100.0)
    assert [(a.job, a.workers) for a in d.admit] == [("v2", 2)]


def test_a_teams_urgent_job_at_its_quota_shrinks_the_teams_own_lower_priority_job():
    """Within a team priority decides: at the team's quota, its high job takes from its own low
    job (it was queued for the quota, and the low job ran on to its end, on a real head)."""
    q = teams(research=(2, 2))
    low = running("low", 4, 1, 4, "low", team="research")
    d = decide(8, [low], [queued("high", 2, 2, "high", team="research")], q, now=1000.0)
    assert d.workers("low") == 2 and d.workers("high") == 2 and not d.waiting
    # of equal priority it still waits for the quota
    d = decide(8, [running("low", 4, 1, 4, "normal", team="research")],
               [queued("next", 2, 2, "normal", team="research")], q, now=1000.0)
    assert d.admit == () and d.waiting[0].why == "quota"


def test_a_job_larger_than_its_teams_whole_quota_says_it_cannot_start():
    d = decide(8, [], [queued("huge", 6, 6, "normal", team="vision")], teams(vision=(2, 2)), now=0.0)
    (w,) = d.waiting
    assert w.why == "quota" and "cannot start here" in w.reason and "scaling.min_workers" in w.reason


def test_a_team_at_its_quota_blocks_no_other_team():
    quotas = teams(vision=(2, 0), nlp=(2, 0))
    d = decide(8, [running("v1", 2, 2, 2, "normal", team="vision")],
               [queued("v2", 2, 2, "normal", team="vision", at=1.0), queued("n1", 2, 2, "normal", team="nlp", at=2.0)],
               quotas, now=1000.0)
    assert [a.job for a in d.admit] == ["n1"]


def test_borrowing_team_is_shrunk_first_when_the_lender_submits():
    quotas = teams(vision=(2, 2), nlp=(2, 2))
    # vision runs 4 workers on a 4-slot cluster: 2 of them borrowed from nlp's idle share
    borrower = running("v1", 4, 1, 4, "normal", team="vision")
    d = decide(4, [borrower], [queued("n1", 2, 2, "normal", team="nlp")], quotas, now=1000.0)
    assert d.workers("v1") == 2 and d.workers("n1") == 2 and d.suspend == ()


def test_reclaim_takes_back_only_the_loan_never_the_borrowers_own_share():
    quotas = teams(vision=(2, 2), nlp=(2, 2))
    borrower = running("v1", 3, 1, 3, "normal", team="vision")  # 1 borrowed
    d = decide(4, [borrower], [queued("n1", 2, 2, "normal", team="nlp")], quotas, now=1000.0)
    assert d.workers("v1") == 2 and d.workers("n1") == 2
    # nlp asking for more than its guarantee cannot take vision's own share
    d = decide(4, [running("v1", 2, 1, 2, "normal", team="vision")], [queued("n1", 3, 3, "normal", team="nlp")],
               quotas, now=1000.0)
    assert d.admit == () and d.shrink == ()


def test_another_teams_guarantee_is_never_taken_even_by_a_higher_priority_job():
    quotas = teams(vision=(4, 0), nlp=(0, 4))
    own = running("v1", 4, 1, 4, "low", team="vision")  # within vision's guarantee
    d = decide(4, [own], [queued("n1", 2, 2, "high", team="nlp")], quotas, now=1000.0)
    assert d.admit == () and d.shrink == () and d.waiting[0].why == "capacity"


def test_a_higher_priority_job_takes_only_what_another_team_borrows():
    quotas = teams(vision=(2, 2), nlp=(2, 4))
    borrower = running("v1", 4, 1, 4, "low", team="vision")  # 2 own + 2 borrowed
    d = decide(4, [borrower], [queued("n1", 3, 3, "high", team="nlp")], quotas, now=1000.0)
    assert d.admit == ()  # 3 would need 1 of vision's own 2
    d = decide(4, [borrower], [queued("n1", 2, 2, "high", team="nlp")], quotas, now=1000.0)
    assert d.workers("v1") == 2 and d.workers("n1") == 2


def test_a_team_reclaims_its_guarantee_even_from_a_higher_priority_borrower():
    quotas = teams(vision=(2, 2), nlp=(2, 2))
    borrower = running("v1", 4, 1, 4, "high", team="vision")
    d = decide(4, [borrower], [queued("n1", 2, 2, "low", team="nlp")], quotas, now=1000.0)
    assert d.workers("v1") == 2 and d.workers("n1") == 2


def test_own_lower_priority_job_gives_after_other_teams_borrowers():
    quotas = teams(vision=(4, 0), nlp=(2, 2))
    mine = running("v-low", 2, 1, 2, "low", team="vision")
    lent = running("n1", 2, 1, 2, "normal", team="nlp")  # within nlp's guarantee: not lent
    d = decide(4, [mine, lent], [queued("v-high", 1, 1, "high", team="vision")], quotas, now=1000.0)
    assert d.workers("v-low") == 1 and d.workers("n1") is None
    borrower = running("n2", 2, 1, 2, "normal", team="nlp", submitted_at=1.0)  # nlp now borrows 2
    d = decide(6, [mine, lent, borrower], [queued("v-high", 1, 1, "high", team="vision")], quotas, now=1000.0)
    assert d.workers("v-low") is None and d.workers("n2") == 1


def test_growth_stays_within_the_team_quota():
    quotas = teams(vision=(2, 1), nlp=(2, 2))
    d = decide(8, [running("v1", 1, 1, 8, "normal", team="vision")], [], quotas, now=1000.0)
    assert [(g.job, g.workers) for g in d.grow] == [("v1", 3)]


# --- cloud bursts, all jobs in one request -------------------------------------------------------

GPU = {"CPU": 8.0, "GPU": 1.0, "site_cloud": 0.001}


def test_two_bursts_make_one_request_of_their_sum():
    plan = aggregate_bursts([BurstRequest("a", "default", 2, GPU), BurstRequest("b", "default", 3, GPU)], {}, QUOTAS)
    assert len(plan.bundles) == 5 and plan.granted == {"a": 2, "b": 3} and plan.refused == ()


def test_cloud_budget_reached_refuses_the_burst_naming_team_and_budget_others_continue():
    quotas = Quotas.model_validate({"teams": {
        "vision": {"onprem": {"guaranteed": 4}, "cloud": {"borrow": 16}, "cloud_budget": {"gpu_hours_per_day": 100}},
        "nlp": {"cloud": {"borrow": 16}, "cloud_budget": {"cost_per_day": 500}}}, "defaults": {"team": "nlp"}})
    use = {"vision": CloudUse(gpu_hours=100.5), "nlp": CloudUse(cost=120.0)}
    plan = aggregate_bursts([BurstRequest("v", "vision", 2, GPU), BurstRequest("n", "nlp", 1, GPU)], use, quotas)
    assert plan.granted == {"n": 1} and len(plan.bundles) == 1
    (r,) = plan.refused
    assert r.job == "v" and "'vision'" in r.reason and "100 GPU-hours per day" in r.reason
    # and on-prem admission for that team goes on regardless
    assert [a.job for a in decide(4, [], [queued("v2", 2, 2, team="vision")], quotas, now=0.0).admit] == ["v2"]


def test_cloud_quota_caps_a_teams_bursts():
    quotas = Quotas.model_validate({"teams": {"vision": {"cloud": {"guaranteed": 1, "borrow": 2}}}})
    plan = aggregate_bursts([BurstRequest("a", "vision", 2, GPU), BurstRequest("b", "vision", 2, GPU),
                             BurstRequest("c", "vision", 1, GPU)], {}, quotas)
    assert plan.granted == {"a": 2, "b": 1} and len(plan.bundles) == 3
    assert [r.job for r in plan.refused] == ["c"] and "cloud quota of 3" in plan.refused[0].reason


def test_a_teams_use_counts_gpu_hours_and_cost_from_the_node_price_labels():
    from tidal.prices import PRICE_LABEL, worker_price

    # a 2-GPU worker on an 8-GPU node priced 32.00 per hour pays a quarter of it
    price = worker_price({PRICE_LABEL: "32.00"}, {"GPU": 8, "CPU": 96}, cpus=8, gpus=2)
    use = CloudUse().plus(hours=3, gpus=2, price_per_hour=price).plus(hours=1, gpus=2, price_per_hour=price)
    assert (use.gpu_hours, use.cost) == (8.0, 32.0)
    quotas = Quotas.model_validate({"teams": {"v": {"cloud": {"borrow": 8}, "cloud_budget": {"cost_per_day": 32}}}})
    (r,) = aggregate_bursts([BurstRequest("j", "v", 1, GPU)], {"v": use}, quotas).refused
    assert "32 per day" in r.reason and "32.00 spent today" in r.reason


# --- every rule on every path (issue #52) --------------------------------------------------------

def test_nothing_is_suspended_for_a_job_that_cannot_be_placed_anyway():
    """Capacity 5; team a guaranteed 3, team b 4. a's low elastic job runs at 1 worker, b's
    4-worker job runs; a's high 3-worker job arrives. Within a's quota it would take the low
    job's worker, but even then only 1 slot is free and b's job holds its guarantee: the high job
    waits and the low job trains on (it used to be suspended, and its slot idled)."""
    quotas = teams(a=(3, 0), b=(4, 0))
    low = running("a-low", 1, 1, 3, "low", team="a")
    b = running("b-job", 4, 4, 4, "normal", team="b")
    d = decide(5, [low, b], [queued("a-high", 3, 3, "high", team="a")], quotas, now=1000.0)
    assert d.suspend == () and d.shrink == () and d.admit == ()
    (w,) = d.waiting
    assert w.job == "a-high" and w.why == "capacity"


def test_a_large_job_that_has_waited_long_enough_holds_back_same_priority_backfill():
    """Small jobs of the same priority may start past a large waiting one (backfill) until it
    has waited `reserve_after_s`; from then on it holds a reservation, and they wait, naming it."""
    quotas = Quotas(min_resize_interval_s=GAP, reserve_after_s=300)
    busy = running("busy", 3, 3, 3, "normal")
    waiting = [queued("big", 4, 4, "normal", at=0.0), queued("small", 1, 1, "normal", at=10.0)]
    early = decide(4, [busy], waiting, quotas, now=100.0)
    assert [a.job for a in early.admit] == ["small"]  # backfill while big has waited 100 s
    late = decide(4, [busy], waiting, quotas, now=400.0)
    assert late.admit == ()
    assert [(w.job, w.why) for w in late.waiting] == [("big", "capacity"), ("small", "reservation")]
    assert "'big'" in late.waiting[1].reason and "reserve_after_s" in late.waiting[1].reason
    # nor does a running job of that priority grow into the slot the reservation waits for
    elastic = running("elastic", 2, 1, 3, "normal")
    assert decide(4, [elastic, running("one", 1, 1, 1, "normal")], waiting[:1], quotas, now=400.0).grow == ()


def test_a_reservation_does_not_hold_back_another_teams_job_within_its_guarantee():
    quotas = Quotas.model_validate({"min_resize_interval_s": GAP, "reserve_after_s": 300, "defaults": {"team": "a"},
                                    "teams": {"a": {"onprem": {"guaranteed": 2, "borrow": 2}},
                                              "b": {"onprem": {"guaranteed": 2, "borrow": 0}}}})
    busy = running("a-busy", 3, 3, 3, "normal", team="a")
    d = decide(4, [busy], [queued("a-big", 4, 4, "normal", team="a", at=0.0),
                           queued("b-small", 1, 1, "normal", team="b", at=10.0)], quotas, now=1000.0)
    assert [a.job for a in d.admit] == ["b-small"]


def test_slots_are_what_ray_places_cpus_or_gpus_per_worker():
    """Capacity counts on-prem CPUs (unit workers) or GPUs (unit gpus): a worker is as many slots
    as it asks of Ray. Two 2-worker jobs at 4 CPUs a worker on 8 CPUs: one runs, one waits."""
    assert Quotas(unit="workers").slots_per_worker(cpus=4, gpus=0) == 4
    assert Quotas(unit="workers").slots_per_worker(cpus=0.5, gpus=0) == 1
    assert Quotas(unit="gpus").slots_per_worker(cpus=8, gpus=2) == 2
    jobs = [QueuedJob(j, "default", "normal", 2, 2, at, slots_per_worker=4) for j, at in (("a", 1.0), ("b", 2.0))]
    d = decide(8, [], jobs, QUOTAS, now=10.0)
    assert [a.job for a in d.admit] == ["a"] and d.waiting[0].job == "b"
