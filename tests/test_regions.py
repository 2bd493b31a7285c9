"""A job's regions: what the user may name (and is refused before anything starts), what
the spec keeps, the expected cost of a job per instance type and region (transfer of
the checkpoint to and from home, requests, the placement score), the launch's ranking,
Spot placement scores (EC2's, checked against botocore's model with its ``Stubber``, and
the local cloud's simulated ones), the picker's type x region rows and region filter,
and ``spotnb catalog --region``."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aws_reference import floor

import spotnb
from spotnb.client.cli import main
from spotnb.protocol import usage
from spotnb.protocol.spec import JobSpec, Resources, SpecError
from spotnb.providers import catalog, regions
from spotnb.providers.placement import (
    PlacementScores,
    fetch_placement_scores,
    simulated_placement_scores,
)
from spotnb.providers.regions import (
    ExpectedCost,
    expected_cost,
    job_regions,
    rank_regions,
    transfer_price,
)

CODE = "x = 1"


@pytest.fixture
def ip(spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The test IPython shell with spotnb loaded (as tests/test_magics.py has it); its
    settings back to their defaults afterwards."""
    from IPython.core.getipython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    from spotnb.client.magics import SpotMagics

    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "spotnb")
    monkeypatch.chdir(tmp_path)
    yield shell
    magics = shell.magics_manager.registry["SpotMagics"]
    for name, trait in SpotMagics.class_traits(config=True).items():
        setattr(magics, name, trait.default())


@pytest.fixture(autouse=True)
def _no_allowed_regions(monkeypatch: pytest.MonkeyPatch, spotnb_home: Path) -> None:
    """Each test starts with no allowed regions set, in a fresh SPOTNB_HOME."""
    monkeypatch.delenv(regions.ENV_ALLOWED, raising=False)
    monkeypatch.delenv("SPOTNB_LOCAL_NO_CAPACITY", raising=False)


# -- what a user may name -----------------------------------------------------------------

def test_a_job_names_several_regions_and_the_first_is_home() -> None:
    for value in ("us-east-1, us-west-2,us-east-1", ["us-east-1", "us-west-2"]):
        spec = spotnb.prepare(CODE, instance_types=["g5.xlarge"], region=value)
        assert spec.resources.regions == ("us-east-1", "us-west-2")
        assert spec.resources.region == "us-east-1"  # the store's region
    # One region, as before: nothing changes for a job that names one.
    spec = spotnb.prepare(CODE, instance_types=["g5.xlarge"])
    assert spec.resources.region == "us-east-1" and spec.resources.regions == ("us-east-1",)


def test_an_unknown_region_is_refused_with_the_names_it_resembles() -> None:
    with pytest.raises(SpecError, match=r"unknown AWS region 'eu-west1': did you mean "
                                        r"'eu-west-1'") as err:
        spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="us-east-1,eu-west1")
    assert err.value.field == "region"
    assert err.value.message({"region": "--region"}).startswith("--region: ")
    with pytest.raises(SpecError, match="must be region names"):
        spotnb.prepare(CODE, region=3)
    with pytest.raises(SpecError, match="is empty"):
        spotnb.prepare(CODE, region=" , ")


def test_a_region_outside_the_allowed_ones_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    eu = ["eu-west-1", "eu-central-1"]
    with pytest.raises(SpecError, match=r"us-east-1 is not among the regions you allow "
                                        r"\(eu-west-1, eu-central-1\)") as err:
        spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="us-east-1",
                       allowed_regions=eu)
    assert "SpotMagics.allowed_regions" in str(err.value)  # how to allow it
    assert f"${regions.ENV_ALLOWED}" in str(err.value)
    # Code outside a notebook allows regions with the environment.
    monkeypatch.setenv(regions.ENV_ALLOWED, "eu-west-1,eu-central-1")
    with pytest.raises(SpecError, match="not among the regions you allow"):
        spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="us-east-1")
    spec = spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="eu-central-1")
    assert spec.resources.regions == ("eu-central-1",)
    monkeypatch.setenv(regions.ENV_ALLOWED, "eu-west-1,eu-wset-2")
    with pytest.raises(SpecError, match=rf"\${regions.ENV_ALLOWED}: unknown AWS region "
                                        "'eu-wset-2': did you mean 'eu-west-2'"):
        spotnb.prepare(CODE, instance_types=["g5.xlarge"])


def test_any_is_the_allowed_regions_that_offer_the_types(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SpecError, match="you allow none yet") as err:
        spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="any")
    assert "SpotMagics.allowed_regions" in str(err.value)
    assert "us-east-1,us-west-2" in str(err.value)  # or name them
    # af-south-1 has no p5.48xlarge: `any` leaves it out, a named region is refused.
    allowed = ["af-south-1", "us-east-2", "us-east-1"]
    assert not catalog.pools("p5.48xlarge", "af-south-1")
    spec = spotnb.prepare(CODE, instance_types=["p5.48xlarge"], region="any",
                          allowed_regions=allowed)
    assert spec.resources.regions == ("us-east-2", "us-east-1")
    assert spec.resources.region == "us-east-2"
    with pytest.raises(SpecError, match=r"none of p5\.48xlarge has a spot pool in "
                                        r"af-south-1.*regions that have it: .*us-east-1.*"
                                        r"Drop af-south-1"):
        spotnb.prepare(CODE, instance_types=["p5.48xlarge"], region="us-east-1,af-south-1")
    with pytest.raises(SpecError, match="Choose one of them as the region"):
        spotnb.prepare(CODE, instance_types=["p5.48xlarge"], region="af-south-1")
    with pytest.raises(SpecError, match=r"none of p5\.48xlarge has a spot pool in the "
                                        "regions you allow"):
        spotnb.prepare(CODE, instance_types=["p5.48xlarge"], region="any",
                       allowed_regions=["af-south-1"])
    with pytest.raises(SpecError, match="'any' stands for every region you allow, alone"):
        spotnb.prepare(CODE, region="any,us-east-1", allowed_regions=allowed)
    monkeypatch.setenv(regions.ENV_ALLOWED, "us-west-2")
    assert spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="any"
                          ).resources.regions == ("us-west-2",)


def test_an_unknown_type_is_named_before_the_regions() -> None:
    with pytest.raises(SpecError, match=r"unknown instance type 'g5\.xlarg'"):
        job_regions("us-east-1,us-west-2", ["g5.xlarg"])


def test_the_magics_name_the_option_and_the_setting(ip: Any) -> None:
    from IPython.core.error import UsageError
    from traitlets import TraitError

    magics = ip.magics_manager.registry["SpotMagics"]
    with pytest.raises(TraitError, match="did you mean 'eu-west-1'"):
        magics.allowed_regions = ["eu-west1"]
    magics.allowed_regions = "eu-west-1, eu-central-1"
    assert magics.allowed_regions == ["eu-west-1", "eu-central-1"]
    with pytest.raises(UsageError, match=r"^--region: us-west-2 is not among the regions "
                                         r"you allow \(eu-west-1, eu-central-1\)"):
        ip.run_cell_magic("spot_train", "--region us-west-2 --detach", "x = 1\n")
    magics.region = "us-west-2"
    with pytest.raises(UsageError, match=r"^SpotMagics\.region: us-west-2 is not among"):
        ip.run_cell_magic("spot_train", "--detach", "x = 1\n")
    request = magics.train_request("--region any")
    spec = spotnb.prepare(CODE, **{**request.submit, "name": "j"})
    assert spec.resources.regions == ("eu-west-1", "eu-central-1")
    with pytest.raises(UsageError, match="did you mean 'eu-west-1'"):
        ip.run_line_magic("spot_picker", "--region eu-west1")


# -- what the spec keeps --------------------------------------------------------------------

def test_the_spec_keeps_the_regions_and_reads_old_specs() -> None:
    spec = spotnb.prepare(CODE, instance_types=["g5.xlarge"], region="us-west-2,eu-west-1")
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.resources.regions == ("us-west-2", "eu-west-1")
    # A spec.json written before jobs had several regions: its home, alone.
    raw = json.loads(spec.to_json())
    del raw["resources"]["regions"]
    old = JobSpec.from_json(json.dumps(raw))
    assert old.resources.regions == ("us-west-2",) and old.resources.region == "us-west-2"
    with pytest.raises(SpecError, match=r"home region us-east-1 \(where its store is\) "
                                        "must be one of its regions us-west-2"):
        Resources(instance_types=("g5.xlarge",), region="us-east-1", regions=("us-west-2",))
    with pytest.raises(SpecError, match="without repeats"):
        Resources(instance_types=("g5.xlarge",), regions=("us-east-1", "us-east-1"))
    raw["resources"]["regions"] = "us-west-2"
    with pytest.raises(SpecError, match="a list of names"):
        JobSpec.from_json(json.dumps(raw))


# -- the expected cost ---------------------------------------------------------------------

def _cost(region: str, spot: float, **kw: Any) -> ExpectedCost:
    base: dict[str, Any] = {"instance_type": "g5.xlarge", "region": region,
                            "home": "us-east-1", "spot": spot, "ondemand": 1.0,
                            "interruption_max_pct": None, "speed": 1.0, "work_hours": 100.0,
                            "checkpoint_seconds": 600.0}
    return expected_cost(**{**base, **kw})


def test_a_cheaper_region_far_from_home_loses_to_home_with_a_large_state() -> None:
    home, away = _cost("us-east-1", 0.40), _cost("us-west-2", 0.36)
    assert away.total_usd < home.total_usd  # no checkpoint: the cheaper spot wins
    home, away = (_cost("us-east-1", 0.40, state_gb=20.0),
                  _cost("us-west-2", 0.36, state_gb=20.0))
    assert home.transfer_usd == 0 and home.transfer_gb == 0
    # 100 h, a save every 10 minutes, no interruption: 600 saves of 20 GB sent home.
    assert away.transfer_gb == pytest.approx(600 * 20.0)
    assert away.transfer_usd == pytest.approx(600 * 20.0 * 0.02)
    assert home.total_usd < away.total_usd
    assert min([away, home], key=ExpectedCost.rank_key) is home
    # The store's requests are the same wherever the job runs: 20 GB is 1,193 parts.
    parts = math.ceil(20 * regions.GB / regions.S3_PART_BYTES)
    assert parts == 1193
    assert home.requests_usd == pytest.approx(away.requests_usd) == pytest.approx(
        600 * (regions.SAVE_WRITES + parts) * usage.PRICES["s3-write"])


def test_restores_come_from_home_and_saves_go_home_at_each_sides_rate() -> None:
    # AWS charges the sending region: Cape Town's rate for saves, Virginia's for restores.
    assert transfer_price("af-south-1", "us-east-1") == 0.147
    assert transfer_price("us-east-1", "af-south-1") == 0.02
    assert transfer_price("us-east-1", "us-east-2") == 0.01  # the one cheaper pair
    assert transfer_price("eu-west-1", "eu-west-1") == 0.0
    # A pair the bundled table lacks: the sending region's rate to the others.
    assert transfer_price("ap-southeast-3", "ap-northeast-3") == \
        transfer_price("ap-southeast-3", "us-east-1") == 0.1
    cost = _cost("af-south-1", 1.0, interruption_max_pct=100.0, state_gb=10.0, nodes=2,
                 resume=True)
    rate = 100.0 / 100 / regions.MONTH_HOURS * 2
    overhead = 600 / 3600 / 2 + regions.RESTART_HOURS
    billed = 100.0 / 2 / (1 - rate * overhead)
    interruptions = rate * billed
    saves = billed * 3600 / 600 + interruptions  # each interruption's forced save too
    restores = interruptions + 1  # the first start restores: the job resumes
    assert cost.billed_hours == pytest.approx(billed)
    assert cost.interruptions == pytest.approx(interruptions)
    assert cost.spot_usd == pytest.approx(billed * 1.0 * 2)
    assert cost.transfer_usd == pytest.approx(restores * 2 * 10 * 0.02 + saves * 10 * 0.147)


def test_a_placement_score_of_one_ranks_last_when_it_is_believed() -> None:
    cheap_but_full = _cost("us-west-2", 0.30, score=1)
    dearer = _cost("us-east-1", 0.40, score=7)
    assert not cheap_but_full.likely
    assert sorted([cheap_but_full, dearer], key=ExpectedCost.rank_key) == [dearer,
                                                                          cheap_but_full]
    # AWS scores one or two types "always low": such a 1 demotes nothing.
    doubtful = _cost("us-west-2", 0.30, score=1, decisive=False)
    assert doubtful.likely
    assert min([doubtful, dearer], key=ExpectedCost.rank_key) is doubtful


def test_the_launch_ranks_the_jobs_regions() -> None:
    spec = spotnb.prepare(CODE, instance_types=["g5.xlarge", "g4dn.xlarge"],
                          region="us-east-1,us-east-2,eu-west-1")
    ranked = rank_regions(spec)
    # Without a checkpoint to move, the cheapest spot wins: Ohio's g4dn.xlarge.
    assert ranked[0].region == "us-east-2"
    assert ranked[0].cost.instance_type == "g4dn.xlarge"
    assert "store in us-east-1" in ranked[0].why
    # A 50 GB checkpoint saved every 5 minutes: staying home is cheaper.
    heavy = rank_regions(spec, state_bytes=50 * 2**30)
    assert heavy[0].region == "us-east-1"
    assert heavy[-1].region == "eu-west-1"
    assert "home" in heavy[0].why
    # EC2 finds no capacity at home: it goes last, whatever it costs.
    full = PlacementScores(("g5.xlarge", "g4dn.xlarge", "g6.xlarge"), 1, {
        ("us-east-1", "use1-az1"): 1, ("us-east-2", "use2-az1"): 8,
        ("eu-west-1", "euw1-az1"): 6}, time.time(), "test")
    assert [c.region for c in rank_regions(spec, state_bytes=50 * 2**30, scores=full)] == \
        ["us-east-2", "eu-west-1", "us-east-1"]
    assert "not likely to have capacity" in rank_regions(spec, scores=full)[-1].why


def test_the_part_size_is_the_s3_stores() -> None:
    from spotnb.providers.aws.store import STREAM_PART_BYTES

    assert regions.S3_PART_BYTES == STREAM_PART_BYTES


# -- placement scores ------------------------------------------------------------------------

def _ec2() -> Any:
    import botocore.session

    return botocore.session.get_session().create_client(
        "ec2", region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing")


def test_placement_scores_are_fetched_for_every_region_ten_at_a_time() -> None:
    from botocore.stub import Stubber

    types = ["g5.xlarge", "g5.2xlarge", "g4dn.xlarge"]
    wanted = catalog.all_regions()[:12]
    ec2 = _ec2()
    first = {"InstanceTypes": types, "TargetCapacity": 4, "SingleAvailabilityZone": True,
             "RegionNames": wanted[:10], "MaxResults": 1000}
    with Stubber(ec2) as stub:
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": wanted[0], "AvailabilityZoneId": "az-a", "Score": 3},
            {"Region": wanted[0], "AvailabilityZoneId": "az-b", "Score": 7}],
            "NextToken": "page-2"}, first)
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": wanted[1], "AvailabilityZoneId": "az-c", "Score": 1}]},
            {**first, "NextToken": "page-2"})
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": wanted[11], "AvailabilityZoneId": "az-d", "Score": 10}]},
            {**first, "RegionNames": wanted[10:]})
        scores = fetch_placement_scores(ec2, types, wanted, 4, clock=lambda: 1000.0)
        stub.assert_no_pending_responses()
    for request in (first, {**first, "NextToken": "page-2"},
                    {**first, "RegionNames": wanted[10:]}):
        assert floor.validate("ec2", "GetSpotPlacementScores", request) == []
    assert dict(scores.scores) == {(wanted[0], "az-a"): 3, (wanted[0], "az-b"): 7,
                                   (wanted[1], "az-c"): 1, (wanted[11], "az-d"): 10}
    assert scores.region_score(wanted[0]) == 7  # a one-node group takes the best AZ
    assert scores.region_score(wanted[5]) is None
    assert scores.decisive and scores.covers("g4dn.xlarge") and not scores.covers("p5.4xl")
    assert scores.age_text(now=1000.0 + 5) == "just now"
    assert scores.age_text(now=1000.0 + 300) == "5 min ago"
    assert scores.age_text(now=1000.0 + 7200) == "2 h ago"


def test_scores_of_two_types_are_shown_but_decide_nothing_and_errors_pass_through() -> None:
    from botocore.exceptions import ClientError
    from botocore.stub import Stubber

    ec2 = _ec2()
    with Stubber(ec2) as stub:
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": "us-east-1", "AvailabilityZoneId": "use1-az1", "Score": 1}]})
        stub.add_client_error("get_spot_placement_scores", "UnauthorizedOperation",
                              "You are not authorized to perform this operation.")
        two = fetch_placement_scores(ec2, ["g5.xlarge", "g4dn.xlarge"], ["us-east-1"])
        with pytest.raises(ClientError, match="UnauthorizedOperation"):
            fetch_placement_scores(ec2, ["g5.xlarge"], ["us-east-1"])
    assert not two.decisive and two.region_score("us-east-1") == 1


def test_the_local_cloud_simulates_scores_from_its_capacity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    azs = [p.az for p in catalog.pools("g5.xlarge", "us-east-1")]
    short = {("g5.xlarge", azs[0])}
    scores = simulated_placement_scores(
        ["g5.xlarge"], ["us-east-1", "eu-west-1"],
        has_capacity=lambda name, az: (name, az) not in short, clock=lambda: 5.0)
    assert scores.scores[("us-east-1", azs[0])] == 1
    assert all(scores.scores[("us-east-1", az)] == 9 for az in azs[1:])
    assert scores.region_score("us-east-1") == 9 and scores.fetched == 5.0
    # From the local cloud's own setting: no g5.xlarge anywhere.
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", "g5.xlarge")
    none = simulated_placement_scores(["g5.xlarge"], ["us-east-1", "eu-west-1"])
    assert none.region_score("us-east-1") == none.region_score("eu-west-1") == 1
    mixed = simulated_placement_scores(["g5.xlarge", "g4dn.xlarge"], ["us-east-1"])
    assert mixed.region_score("us-east-1") == 9  # another type has capacity


# -- the picker ------------------------------------------------------------------------------

class FakeMagics:
    provider = "local"
    instance_types: list[str] = ["g4dn.xlarge"]
    region = "us-east-1,us-west-2"
    allowed_regions: list[str] = []
    checkpoint_every = "10m"
    gpu_reference = ""


def _picker(magics: Any = None, **kw: Any) -> Any:
    pytest.importorskip("ipywidgets")
    from spotnb.widgets.picker import InstancePicker

    return InstancePicker(magics=magics or FakeMagics(), **kw)


def _labels(picker: Any) -> list[str]:
    return [c["key"] for c in picker.table.columns]


def test_the_picker_ranks_types_by_region_and_filters_regions() -> None:
    picker = _picker(state_gb=0.0)
    assert picker.shown_regions() == ["us-east-1", "us-west-2"]  # the next job's
    assert {r.region for r in picker.shown} == {"us-east-1", "us-west-2"}
    ids = [row["id"] for row in picker.table.rows]
    assert all(re.fullmatch(r"[a-z0-9-]+\.[a-z0-9]+@us-(east-1|west-2)", i) for i in ids)
    assert "region" in _labels(picker)
    totals = [picker._estimate(r).rank_key() for r in picker.shown
              if picker._estimate(r) is not None]
    assert totals == sorted(totals)
    # A 10 GB checkpoint kept in us-east-1: every us-west-2 row pays to move it.
    picker.state_gb.value = 10.0
    away = [r for r in picker.shown if r.region == "us-west-2"]
    assert all(picker._estimate(r).transfer_usd > 0 for r in away  # type: ignore[union-attr]
               if picker._estimate(r) is not None)
    assert "est_transfer_usd" in _labels(picker)
    first = next(r for r in picker.shown if r.instance_type == "g5.xlarge")
    assert first.region == "us-east-1"  # cheaper spot in Oregon, but far from the store
    assert "store stays in us-east-1" in picker.note.value
    # The filter: one region; rows named by their type alone, no region column.
    picker.regions.value = ["us-west-2"]
    assert {r.region for r in picker.shown} == {"us-west-2"}
    assert "region" not in _labels(picker)
    assert picker.table.rows[0]["id"] == picker.shown[0].instance_type
    # Empty: every region.
    picker.regions.value = []
    assert len({r.region for r in picker.shown}) == len(catalog.all_regions())
    assert len(picker.table.rows) <= 300 and "narrow the filters" in picker.note.value


def test_choosing_rows_sets_the_types_and_regions_of_the_next_job() -> None:
    magics = FakeMagics()
    picker = _picker(magics, state_gb=5.0)
    before = [r.key for r in picker.shown]
    picker.chosen.value = ["g5.xlarge@us-west-2", "g4dn.xlarge@us-east-1"]
    assert magics.instance_types == ["g5.xlarge", "g4dn.xlarge"]
    # The home stays the next job's (us-east-1): the store's region comes first.
    assert magics.region == "us-east-1,us-west-2"
    assert "-t g5.xlarge,g4dn.xlarge --region us-east-1,us-west-2" in picker.line.value
    assert [r.key for r in picker.shown] == before  # a choice does not reorder the rows
    picker.chosen.value = ["g5.xlarge@us-west-2"]
    assert magics.region == "us-east-1,us-west-2"
    # The store elsewhere: chosen, and the costs follow it.
    picker.home.value = "us-west-2"
    assert picker.job_regions() == ["us-west-2"]
    g4dn = next(r for r in picker.shown if r.key == "g4dn.xlarge@us-east-1")
    assert picker._estimate(g4dn).transfer_usd > 0  # type: ignore[union-attr]
    picker.chosen.value = ["g5.xlarge@us-west-2", "g4dn.xlarge@us-east-1"]
    assert magics.region == "us-west-2,us-east-1"
    # Filtering to one region renames the chosen rows it shows; the others go.
    picker.regions.value = ["us-west-2"]
    assert list(picker.chosen.value) == ["g5.xlarge"]
    assert picker.table.chosen == ["g5.xlarge"]


def test_the_picker_offers_the_allowed_regions_only() -> None:
    magics = FakeMagics()
    magics.allowed_regions = ["eu-west-1", "eu-central-1"]
    magics.region = "any"
    picker = _picker(magics)
    assert list(picker.regions.allowed_tags) == ["eu-west-1", "eu-central-1"]
    assert picker.shown_regions() == ["eu-west-1", "eu-central-1"]
    assert {r.region for r in picker.shown} == {"eu-west-1", "eu-central-1"}
    picker.regions.value = []
    assert {r.region for r in picker.shown} == {"eu-west-1", "eu-central-1"}


def test_the_picker_shows_the_simulated_scores_and_ranks_a_full_region_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", "g5.xlarge@" + ",g5.xlarge@".join(
        p.az for p in catalog.pools("g5.xlarge", "us-west-2")))
    picker = _picker(state_gb=0.0)
    ranked = [r for r in picker.shown if picker._estimate(r) is not None]
    last = ranked[-1]
    assert last.key == "g5.xlarge@us-west-2"
    cells = {row["id"]: row for row in picker.table.rows}
    assert cells["g5.xlarge@us-west-2"]["cells"]["placement"] == "1"
    assert "not likely to succeed" in cells["g5.xlarge@us-west-2"]["titles"]["placement"]
    assert cells["g5.xlarge@us-east-1"]["cells"]["placement"] == "9"
    assert "placement" in _labels(picker)
    assert "Spot placement scores (the local cloud's simulated capacity" in picker.note.value
    assert "just now" in picker.note.value


def test_the_picker_asks_ec2_for_the_chosen_types_scores_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.stub import Stubber

    from spotnb.providers.aws import _boto

    ec2 = _ec2()
    stub = Stubber(ec2)
    monkeypatch.setattr(_boto, "client", lambda *_a, **_k: ec2)
    magics = FakeMagics()
    magics.provider = "aws"
    magics.instance_types = ["g5.xlarge", "g5.2xlarge", "g4dn.xlarge"]
    stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
        {"Region": "us-east-1", "AvailabilityZoneId": "use1-az1", "Score": 1},
        {"Region": "us-west-2", "AvailabilityZoneId": "usw2-az1", "Score": 8}]},
        {"InstanceTypes": magics.instance_types, "TargetCapacity": 2,
         "SingleAvailabilityZone": True, "RegionNames": ["us-east-1", "us-west-2"],
         "MaxResults": 1000})
    with stub:
        picker = _picker(magics, count=2, state_gb=0.0)
        stub.assert_no_pending_responses()
    cells = {row["id"]: row["cells"] for row in picker.table.rows}
    assert cells["g5.xlarge@us-east-1"]["placement"] == "1"
    assert cells["g5.xlarge@us-west-2"]["placement"] == "8"
    assert cells["g6.xlarge@us-west-2"]["placement"] == "-"  # not among the scored types
    assert ("EC2's, for g5.xlarge, g5.2xlarge, g4dn.xlarge, for 2 instances, just now"
            in picker.note.value)
    order = [r.key for r in picker.shown]
    assert order.index("g5.xlarge@us-east-1") > order.index("g5.xlarge@us-west-2")
    # No permission: said above the table, and the ranking goes on without scores.
    with stub:
        stub.add_client_error("get_spot_placement_scores", "UnauthorizedOperation")
        picker.fetch_scores()
    assert picker.scores == [] and "no Spot placement scores (ClientError" in \
        picker.note.value


def test_the_picker_reads_without_widgets_with_its_regions() -> None:
    picker = _picker(state_gb=3.0)
    picker.chosen.value = ["g5.xlarge@us-east-1"]
    page = picker.static_html()
    assert ">region</th>" in page and "us-west-2" in page
    assert "%%spot_train -t g5.xlarge</code>" in page  # home's row: no --region
    assert "region" in picker.text().splitlines()[0]


# -- spotnb catalog --------------------------------------------------------------------------

def test_catalog_lists_several_regions_and_any(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["catalog", "--gpu", "a10g", "--region", "us-east-1,eu-west-1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = re.split(r"\s{2,}", lines[0])
    assert header[:3] == ["TYPE", "REGION", "GPUS"]
    rows = [dict(zip(header, re.split(r"\s{2,}", line), strict=True))
            for line in lines[1:] if line.startswith("g")]
    assert {r["REGION"] for r in rows} == {"us-east-1", "eu-west-1"}
    spots = [float(r["SPOT $/H"]) for r in rows]
    assert spots == sorted(spots)
    assert "in us-east-1, eu-west-1" in lines[-1]
    assert main(["catalog", "--region", "any"]) == 2
    assert "you allow none yet" in capsys.readouterr().err
    monkeypatch.setenv(regions.ENV_ALLOWED, "eu-central-1,eu-west-2")
    assert main(["catalog", "--region", "any", "--gpu", "t4"]) == 0
    out = capsys.readouterr().out
    assert "eu-central-1" in out and "eu-west-2" in out and "us-east-1" not in out
    assert main(["catalog", "--region", "us-east-1,us-west-2"]) == 2
    assert "not among the regions you allow" in capsys.readouterr().err
    assert main(["catalog", "--region", "eu-west1"]) == 2
    assert "did you mean eu-west-1" in capsys.readouterr().err
