"""The lighthouse's death is named at once (issue 42, row 10): the live-recovery launcher watches the lighthouse it
started (a real torchft_lighthouse); when it dies, one line names it, every replica group (real torchrun agents) is
stopped and the launcher ends in LighthouseDied (the CLI's exit code 3), instead of every group timing out."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("torchft")


def test_a_killed_lighthouse_stops_every_replica_group_with_a_line_naming_it(tmp_path, monkeypatch, capfd):
    from syncwise.launch import ft

    started = []

    class Recorded(ft.Lighthouse):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(ft, "Lighthouse", Recorded)
    ready = tmp_path / "ready"
    ready.mkdir()
    script = tmp_path / "replica.py"
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(ready)!r}, os.environ['SYNCWISE_FT_REPLICA']).touch()\n"
                      "time.sleep(600)\n")

    def kill_when_both_run():
        while len(list(ready.iterdir())) < 2:
            threading.Event().wait(0.1)
        started[0].proc.kill()

    killer = threading.Thread(target=kill_when_both_run, daemon=True)
    killer.start()
    with pytest.raises(ft.LighthouseDied) as e:
        ft.run_replicas([str(script)], tmp_path / "run", replicas=2, nproc=1, restarts=0)
    text = str(e.value)
    assert "lighthouse" in text and "signal 9" in text and "--resume auto" in text and len(text.splitlines()) == 1
    assert e.value.exit_code == 3
    assert "syncwise: live recovery: torchft's lighthouse" in capfd.readouterr().err
    # every group's agent and worker are gone (the launcher waited for them)
    import subprocess

    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert not left, left
