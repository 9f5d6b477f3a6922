"""The store's CLI commands through ``rowcache.cli.app.main``."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from rowcache.cli.app import main


def _npy(tmp_path, rng, name="t", rows=300, dim=16):
    x = rng.standard_normal((rows, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
    p = tmp_path / f"{name}.npy"
    np.save(p, x.view(np.uint16))
    return p, x


def test_cli_build_inspect_verify_json(tmp_path, rng, capsys):
    p, _ = _npy(tmp_path, rng)
    assert (
        main(
            [
                "build",
                str(tmp_path / "s"),
                "--table",
                f"emb={p}",
                "--no-progress",
                "--shard-mib",
                "0.004",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "s"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (
        rep["dtype"] == "bf16"
        and rep["tables"][0]["name"] == "emb"
        and rep["tables"][0]["rows"] == 300
    )
    assert rep["tables"][0]["shards"] == len(rep["tables"][0]["shard_files"]) >= 2
    assert main(["inspect", str(tmp_path / "s")]) == 0
    assert "emb" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "s"), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_cli_verify_fails_with_exit_1_on_corruption(tmp_path, rng, capsys):
    p, _ = _npy(tmp_path, rng)
    main(["build", str(tmp_path / "s"), "--table", str(p), "--no-progress", "--dtype", "fp8"])
    shard = next(f for f in os.listdir(tmp_path / "s") if f.endswith(".bin"))
    with open(tmp_path / "s" / shard, "r+b") as f:
        f.write(b"\xff")
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "s"), "--no-progress"]) == 1
    assert "problem" in capsys.readouterr().out


def test_cli_build_from_longcat_safetensors(tmp_path, rng, capsys):
    ws = [
        rng.standard_normal((20 + i, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
        for i in range(3)
    ]
    header, off = {}, 0
    for i, w in enumerate(ws):
        header[f"model.ngram_embeddings.embedders.{i}.weight"] = {
            "dtype": "BF16",
            "shape": list(w.shape),
            "data_offsets": [off, off + w.nbytes],
        }
        off += w.nbytes
    hb = json.dumps(header).encode()
    with open(tmp_path / "m.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + b"".join(w.tobytes() for w in ws))
    assert (
        main(
            [
                "build",
                str(tmp_path / "s"),
                "--safetensors",
                str(tmp_path / "m.safetensors"),
                "--no-progress",
                "--json",
            ]
        )
        == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in rep["tables"]] == ["ngram.0", "ngram.1", "ngram.2"]
    assert [t["rows"] for t in rep["tables"]] == [20, 21, 22]


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("rowcache inspect: error:")
        and "Traceback" not in err
    )
    assert main(["build", str(tmp_path / "s")]) == 2
    assert "--table" in capsys.readouterr().err
    assert main(["build", str(tmp_path / "s"), "--table", "x=/no/such.npy"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_build_errors_name_the_flag_or_the_file(tmp_path, rng, capsys):
    p, _ = _npy(tmp_path, rng)
    store = str(tmp_path / "s")
    assert main(["build", store, "--table", f"a={p}", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["build", store, "--table", f"a={p}"]) == 2
    err = _one_line(capsys)
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main(["build", store + "2", "--table", f"a={p}", "--shard-mib", "1e-9"]) == 2
    assert "--shard-mib" in _one_line(capsys) and not os.path.exists(store + "2")
    cut = tmp_path / "cut.npy"
    cut.write_bytes(p.read_bytes()[:1000])
    assert main(["build", store + "3", "--table", f"a={cut}"]) == 2
    err = _one_line(capsys)
    assert str(cut) in err and "not a readable .npy" in err
    st = tmp_path / "m.safetensors"
    x = np.zeros((8, 4), dtype=np.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, x.nbytes]}})
    st.write_bytes(struct.pack("<Q", len(header)) + header.encode() + x.tobytes()[:50])
    assert main(["build", store + "4", "--table", f"w={st}:w"]) == 2
    err = _one_line(capsys)
    assert str(st) in err and "truncated" in err and "mmap" not in err
    assert main(["build", store + "5", "--safetensors", str(st)]) == 2
    assert "truncated" in _one_line(capsys)


def test_cli_store_wording_singular(tmp_path, rng, capsys):
    p, _ = _npy(tmp_path, rng)
    store = str(tmp_path / "s")
    assert main(["build", store, "--table", f"a={p}", "--no-progress"]) == 0
    assert ": 1 table, bf16" in capsys.readouterr().err
    assert main(["-q", "build", store + "q", "--table", f"a={p}"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["verify", store]) == 0
    out = capsys.readouterr().out
    assert ": 1 shard, " in out and "1 shards" not in out


def test_inspect_json_names_the_shard_digest_for_what_it_is(tmp_path, rng):
    """Issue 51, item 12, in a child: each shard's ``page_crcs_crc32c`` (once ``crc32``, a
    name matching neither checksum a user would compute) is the CRC32C of the shard's
    page-CRC record: the CRC32C of every 4 KiB page of the file, little-endian uint32s."""
    import crc32c

    from tests.cli.support import run_cli

    p, _ = _npy(tmp_path, rng, rows=700)
    built = run_cli("build", str(tmp_path / "s"), "--table", f"emb={p}", "--shard-mib", "0.004")
    assert built.returncode == 0, built.stderr
    got = run_cli("inspect", str(tmp_path / "s"), "--json")
    assert got.returncode == 0 and got.stderr == "", got.stderr
    shards = json.loads(got.stdout)["tables"][0]["shard_files"]
    assert len(shards) > 1
    for sh in shards:
        assert "crc32" not in sh
        data = (tmp_path / "s" / sh["file"]).read_bytes()
        pages = [crc32c.crc32c(data[i : i + 4096]) for i in range(0, len(data), 4096)]
        record = np.asarray(pages, dtype="<u4").tobytes()
        assert sh["page_crcs_crc32c"] == f"{crc32c.crc32c(record):08x}", sh
        assert sh["page_crcs_crc32c"] != f"{crc32c.crc32c(data):08x}"  # not the file's
