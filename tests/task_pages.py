"""The command blocks of the four task pages, read as a user's shell reads them, and what the tests
do with each command: run it as written (with the shortening override its page names, where it
trains), serve it until its page answers, or say what these machines lack to run it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

TASK_PAGES = ("quickstart.md", "your-model.md", "tpu-cluster.md", "notebook.md")


@dataclass(frozen=True)
class Step:
    """How a page's command is run: ``added`` words appended (the page's shortening override), a
    server ``url`` polled until it answers and the server stopped, or ``outside`` (why it is not run)."""

    added: str = ""
    url: str = ""
    outside: str = ""


RUN = Step()
SHORT = Step(added="loop.max_steps=20")  # the quick start's and the cluster page's
SHORT_FLAG = Step(added="--max_steps 5")  # the fine-tuning page's
NO_GITHUB = Step(outside="a clone from GitHub: the tests run in this clone's files")
NO_CLOUD = Step(outside="Google Cloud: a local head, with a GCS server on loopback, stands in")

PLANS: dict[str, dict[str, Step]] = {
    "quickstart.md": {
        "git clone https://github.com/raytpu/raytpu.git raytpu && cd raytpu": NO_GITHUB,
        "bash scripts/quickstart.sh": SHORT,
        ".venv/bin/tensorboard --logdir results/mshnet-small/tensorboard --port 6006": Step(
            url="http://127.0.0.1:6006/data/runs"
        ),
        ".venv/bin/raytpu runs results/mshnet-small": RUN,
        ".venv/bin/raytpu test jobs/mshnet/small.yaml --checkpoint best": RUN,
        ".venv/bin/raytpu train jobs/mshnet/small.yaml run.name=lr-0.01 optim.lr=0.01": SHORT,
        ".venv/bin/raytpu train jobs/mshnet/small.yaml run.name=batch-16 data.global_batch_size=16 "
        "loop.epochs=10": SHORT,
    },
    "your-model.md": {
        "bash scripts/bootstrap.sh lm": RUN,
        "source .venv/bin/activate": RUN,
        "raytpu train jobs/causal_lm/finetune.yaml --train_file train.jsonl --validation_file valid.jsonl": SHORT_FLAG,
        "raytpu train jobs/causal_lm/finetune.yaml --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name "
        "Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1 --run_name qwen-wikitext": SHORT_FLAG,
        "raytpu train jobs/causal_lm/finetune.yaml --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct "
        "--train_file chats.jsonl --assistant_only_loss --packing --max_length 1024 --run_name chat": SHORT_FLAG,
        "raytpu train jobs/causal_lm/finetune.yaml --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules "
        "all-linear --learning_rate 2e-4 --train_file chats.jsonl --run_name lora": SHORT_FLAG,
        "raytpu export results/lora/config.yaml --checkpoint best --out adapter/": RUN,
        "raytpu export results/lora/config.yaml --merged --checkpoint best --out merged/": RUN,
        'raytpu tune jobs/causal_lm/finetune.yaml --use_peft --train_file chats.jsonl --search "job.lora_r=choice(8, '
        '16, 32)" --search "optim.lr=loguniform(1e-5, 1e-3)" --samples 6': Step(added="--samples 1 --max_steps 5"),
        "raytpu train jobs/causal_lm/small.yaml": SHORT_FLAG,
        "raytpu train jobs/causal_lm/small.yaml --model_type gpt2 --config_name openai-community/gpt2 "
        '--config_overrides "n_layer=4,n_embd=256,n_head=4" --tokenizer_name openai-community/gpt2 '
        "--train_file corpus.jsonl --run_name gpt2-scratch": SHORT_FLAG,
        "raytpu export jobs/causal_lm/finetune.yaml --checkpoint best --out exported/": RUN,
        'python -c "from transformers import pipeline; '
        "print(pipeline('text-generation', 'exported/')('def ')[0])\"": RUN,
    },
    "tpu-cluster.md": {
        "export PROJECT=my-project-123456 BUCKET=gs://my-raytpu-bucket": RUN,
        "git clone https://github.com/raytpu/raytpu.git raytpu && cd raytpu": NO_GITHUB,
        "bash scripts/bootstrap.sh all": RUN,
        "source .venv/bin/activate": RUN,
        "pip install google-api-python-client": Step(outside="Ray's GCP launcher's: it would change the tests' venv"),
        "gcloud auth login": NO_CLOUD,
        "gcloud auth application-default login": NO_CLOUD,
        "gcloud config set project $PROJECT": NO_CLOUD,
        'sed -i "s/project_id: null/project_id: $PROJECT/" cluster.yaml': RUN,
        "gcloud storage buckets create $BUCKET --location=us-central1": NO_CLOUD,
        "gcloud storage buckets add-iam-policy-binding $BUCKET --role=roles/storage.objectUser "
        "--member=serviceAccount:$(gcloud projects describe $PROJECT --format='value(projectNumber)')"
        "-compute@developer.gserviceaccount.com": NO_CLOUD,
        "ray get-auth-token --generate": RUN,
        "ray up cluster.yaml -y": NO_CLOUD,
        "ray dashboard cluster.yaml &": NO_CLOUD,
        "export RAY_ADDRESS=http://127.0.0.1:8265 RAY_AUTH_MODE=token": RUN,
        "raytpu doctor --address http://127.0.0.1:8265": RUN,
        "raytpu data synth mshnet --out data/mshnet --n 200 --size 64": RUN,
        "raytpu data prepare mshnet --src data/mshnet --out $BUCKET/mshnet-tables": RUN,
        "raytpu submit jobs/mshnet/small.yaml scaling.num_workers=1 data.path=$BUCKET/mshnet-tables "
        "run.storage_path=$BUCKET/runs": SHORT,
        "raytpu submit jobs/mshnet/small.yaml scaling.runtime=cuda run.name=mshnet-t4 data.path=$BUCKET/mshnet-tables "
        "run.storage_path=$BUCKET/runs": Step(outside="a GPU node: the local head has none"),
        """ray job submit --runtime-env-json '{"working_dir": ".", "excludes": ["/.git"]}' -- raytpu train """
        "jobs/mshnet/small.yaml scaling.num_workers=1 data.path=$BUCKET/mshnet-tables "
        "run.storage_path=$BUCKET/runs": SHORT,
        "raytpu runs $BUCKET/runs": RUN,
        "raytpu runs $BUCKET/runs/mshnet-small": RUN,
        """ray job submit --runtime-env-json '{"working_dir": ".", "excludes": ["/.git"]}' -- raytpu test """
        "jobs/mshnet/small.yaml scaling.num_workers=1 data.path=$BUCKET/mshnet-tables run.storage_path=$BUCKET/runs "
        "--checkpoint best": RUN,
        "pip install gcsfs": Step(outside="TensorBoard's reader of gs://: it would change the tests' venv"),
        "tensorboard --logdir $BUCKET/runs/mshnet-small/tensorboard --port 6006": Step(
            outside="TensorBoard reads gs:// through gcsfs (above); it serves a local folder in the quick start's test"
        ),
        "ray down cluster.yaml -y": NO_CLOUD,
    },
    "notebook.md": {
        "git clone https://github.com/raytpu/raytpu.git raytpu && cd raytpu": NO_GITHUB,
        "bash scripts/bootstrap.sh mshnet,notebook": RUN,
        ".venv/bin/pip install jupyter": Step(outside="it would change the venv every other test runs in"),
        ".venv/bin/python -m ipykernel install --user --name raytpu --display-name raytpu": RUN,
        ".venv/bin/jupyter lab": Step(outside="a browser's server: the page's cells run in a real kernel instead"),
    },
}


def commands(page: str) -> list[str]:
    """The page's bash commands in order: continuation lines joined, comments dropped."""
    text = (ROOT / "docs" / page).read_text()
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = without_comment(line).strip()
            if line:
                found.append(line)
    return found


def cells(page: str) -> list[str]:
    """The page's Python blocks (notebook cells), in order."""
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / page).read_text(), re.S | re.M)


def is_install_cell(cell: str) -> bool:
    """A Colab or Kaggle install cell (shell lines: a clone from GitHub, a pip install): not run here."""
    return all(line.startswith(("!", "%")) for line in cell.splitlines() if line.strip())


def without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a shell comment (outside quotes, at a word's start)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def script(page: str, stand_ins: dict[str, str] | None = None) -> str:
    """The page's commands as one bash script, in order, each announced by a ``::: N`` line;
    a server command runs until its url answers, then is stopped. ``stand_ins``: words replaced in
    every command, where what the page names is not this machine's (a tunnel's port, a bucket)."""
    lines = ["set -eo pipefail", SERVE]
    for number, command in enumerate(commands(page)):
        step = PLANS[page][command]
        if step.outside:
            continue
        for word, stand_in in (stand_ins or {}).items():
            command = command.replace(word, stand_in)
        lines.append(f"echo '::: {number}'")
        if step.url:
            url = step.url
            for word, stand_in in (stand_ins or {}).items():
                url = url.replace(word, stand_in)
            lines.append(f"serve {shlex.quote(url)} {command}")
        else:
            lines.append(f"{command} {step.added}".strip())
    return "\n".join(lines) + "\n"


#: a server started in the background, asked for its url until it answers (120 s at most), stopped
SERVE = """serve() {
    local url=$1; shift
    "$@" > server.log 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        if python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" "$url" 2>/dev/null; then
            echo "served: $url"; kill "$pid"; wait "$pid" || true; return 0
        fi
        sleep 1
    done
    kill "$pid"; cat server.log; return 1
}"""


def sandbox(folder: Path) -> Path:
    """A copy of the clone's tracked files, with its ``.venv`` linked, for a page's commands to run
    in as in a fresh clone: what they write lands in it alone, and what they upload is in it."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    (folder / ".venv").symlink_to(ROOT / ".venv")
    return folder


def outputs(stdout: str) -> dict[int, str]:
    """What each command printed, by its number on the page."""
    parts = re.split(r"^::: (\d+)\n", stdout, flags=re.M)
    return {int(number): text for number, text in zip(parts[1::2], parts[2::2], strict=True)}
