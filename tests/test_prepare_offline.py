"""``prepare`` without network (issue 60 item 7): a hub that cannot be reached is one line at once, before
``datasets`` spends a minute retrying; with the offline variables set, a dataset missing from the cache says so."""
import pytest

from fibattn.cli import main
from fibattn.data import hub


@pytest.fixture
def no_download(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(*args, **kwargs):     # what datasets raises offline, without a minute of retries
        calls.append(args)
        raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for name in hub.OFFLINE_VARS + hub.PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    return calls


def one_line(capsys, argv):
    rc = main(argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_no_network_is_one_line_at_once_and_nothing_is_downloaded_or_written(no_download, monkeypatch, capsys,
                                                                             tmp_path):
    monkeypatch.setattr(hub, "hub_problem", lambda: "huggingface.co:443: Name or service not known")
    line = one_line(capsys, ["prepare", "--preset", "paper", "--out", str(tmp_path / "d")])
    assert "data.sources[0]: the Hugging Face hub cannot be reached" in line and "HF_HUB_OFFLINE=1" in line
    assert no_download == [] and not (tmp_path / "d").exists()


def test_offline_variables_skip_the_probe_and_name_themselves(no_download, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_problem", lambda: pytest.fail("probed although offline"))
    line = one_line(capsys, ["prepare", "--preset", "paper", "--out", str(tmp_path / "d")])
    assert "HF_DATASETS_OFFLINE=1 is set" in line and "not in the local Hugging Face cache" in line
    assert len(no_download) == 1 and not (tmp_path / "d").exists()


def test_the_probe_itself(monkeypatch):
    for name in hub.PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid:443")      # never resolves
    hub.hub_problem.cache_clear()
    try:
        assert "hub.invalid:443" in hub.hub_problem()
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # behind a proxy the proxy decides
        hub.hub_problem.cache_clear()
        assert hub.hub_problem() is None
    finally:
        hub.hub_problem.cache_clear()
    assert not hub.is_hub_id(".") and hub.is_hub_id("org/no-such-local-folder")
