"""A real Orthanc (Debian's ``orthanc`` with the ``orthanc-dicomweb`` plugin) on 127.0.0.1 for a
test: free ports, a temporary storage folder, DICOMweb enabled, stopped at the end."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _svc_helpers import free_port

ORTHANC = "/usr/sbin/Orthanc"
_PLUGINS = ("/usr/share/orthanc/plugins/libOrthancDicomWeb.so", "/usr/lib/orthanc/libOrthancDicomWeb.so.1.7")


def _plugin() -> str | None:
    found = [p for p in _PLUGINS if Path(p).is_file()]
    if not found:
        found = sorted(str(p) for p in Path("/usr/lib/orthanc").glob("libOrthancDicomWeb.so*"))
    return found[0] if found else None


@contextmanager
def orthanc(folder: Path) -> Iterator[str]:
    """Start Orthanc with its storage under ``folder``; yields its DICOMweb root URL.

    Skips the test (with the reason) when the Orthanc binary or its DICOMweb plugin is missing.
    """
    binary = shutil.which("Orthanc") or (ORTHANC if Path(ORTHANC).is_file() else None)
    plugin = _plugin()
    if binary is None or plugin is None:
        pytest.skip(
            "Orthanc or its DICOMweb plugin is not installed (apt-get install orthanc orthanc-dicomweb)"
        )
    http_port = free_port()
    config = {
        "Name": "tilewise-test",
        "StorageDirectory": str(folder / "db"),
        "IndexDirectory": str(folder / "db"),
        "HttpPort": http_port,
        "DicomServerEnabled": False,
        "DicomPort": free_port(),
        "RemoteAccessAllowed": False,
        "AuthenticationEnabled": False,
        "Plugins": [plugin],
        "DicomWeb": {"Enable": True, "Root": "/dicom-web/", "EnableWado": True, "Ssl": False},
    }
    (folder / "orthanc.json").write_text(json.dumps(config))
    log = open(folder / "orthanc.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([binary, str(folder / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/dicom-web/studies", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Orthanc did not start: {(folder / 'orthanc.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"{base}/dicom-web"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
