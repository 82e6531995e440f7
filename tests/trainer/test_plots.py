"""Plots a user can read (issue 27 item 16): parity's difference panel shows every run even where runs are
identical (each on a row of its own, with a table of the largest differences), and `train --plot` draws the loss."""
import numpy as np
from click.testing import CliRunner
from matplotlib.colors import to_rgb

from interop.cli.main import main
from interop.convert import convert
from interop.workflows.parity import ParityResult, plot_losses


def _has_colour(pixels, colour) -> bool:
    return bool((np.abs(pixels[..., :3] - np.array(to_rgb(colour))).max(axis=-1) < 0.02).any())


def test_identical_runs_stay_visible(tmp_path):
    """torch 2x1 and torch 2x2 equal the reference at every step (as in the demo): both used to sit on one line at
    1e-12 under torch 1x2; each now has its own row, so each run's colour shows in the difference panel."""
    ref = [6.95, 6.94, 6.948, 6.963, 6.93, 6.96]
    runs = {"torch 1x1": ref, "torch 2x1": list(ref), "torch 1x2": [x + (4.77e-7 if i == 3 else 0) for i, x in enumerate(ref)],
            "torch 2x2": list(ref), "hf": [x + 4.77e-7 for x in ref]}
    path = plot_losses(ParityResult(runs, 1e-5), tmp_path / "parity.png")
    import matplotlib.image
    image = matplotlib.image.imread(path)
    bottom = image[int(image.shape[0] * 0.6):, : int(image.shape[1] * 0.72)]  # the difference panel, no legend
    for k, label in enumerate(runs):
        if label != "torch 1x1":
            assert _has_colour(bottom, f"C{k}"), label


def test_train_plot(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "common", dst_format="interop")
    result = CliRunner().invoke(main, ["train", "--load", str(tmp_path / "common"), "--save", str(tmp_path / "run"),
                                       "--steps", "3", "--global-batch-size", "2", "--seq-length", "16",
                                       "--plot", str(tmp_path / "loss.png")])
    assert result.exit_code == 0, result.output
    assert f"loss curve: {tmp_path / 'loss.png'}" in result.output
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
