"""Play full episodes against an ORS server with an official SDK's client (run with its venv
python).

    python official_client.py ors|openreward URL

Prints one JSON object: what each step returned, for the test to check.
"""

import asyncio
import json
import sys

sdk, url = sys.argv[1], sys.argv[2]


def blocks_text(blocks):
    return "\n".join(b.text for b in blocks if getattr(b, "type", "text") == "text")


async def episode(env, record, **session_args):
    async with env.session(**session_args) as session:
        prompt = await session.get_prompt()
        tools = await session.list_tools()
        steps = [
            await session.call_tool("hint", {}),
            await session.call_tool("note", {"text": "carry the one"}),
        ]
        whoami = await session.call_tool("whoami", {})
        try:
            await session.call_tool("no_such_tool", {})
            unknown = "ran"
        except Exception as exc:
            unknown = f"{type(exc).__name__}: {exc}"
        try:
            await session.call_tool("answer", {"answer": 42})
            invalid = "ran"
        except Exception as exc:
            invalid = f"{type(exc).__name__}: {exc}"
        question = blocks_text(prompt)
        answers = {
            "What is 17 + 25?": "42",
            "What is 9 * 8?": "72",
            "What is 100 - 37?": "63",
            "What is 144 / 12?": "12",
            "What is 6 * 7?": "42",
        }
        final = await session.call_tool("answer", {"answer": answers[question]})
        try:
            await session.call_tool("answer", {"answer": answers[question]})
            after_finished = "ran"
        except Exception as exc:
            after_finished = f"{type(exc).__name__}: {exc}"
        record.append(
            {
                "prompt": question,
                "tools": sorted(t.name for t in tools),
                "rewards": [s.reward for s in steps] + [final.reward],
                "finished": [s.finished for s in steps] + [final.finished],
                "metadata": final.metadata,
                "final_text": blocks_text(final.blocks),
                "whoami": blocks_text(whoami.blocks),
                "unknown_tool": unknown,
                "invalid_input": invalid,
                "after_finished": after_finished,
            }
        )


async def main():
    record = []
    if sdk == "ors":
        from ors.client import AsyncORS

        client = AsyncORS(base_url=url)  # keep it referenced: its __del__ closes the HTTP sessions
        env = client.environment("arithenv")
        discovery = {
            "splits": await env.list_splits(),
            "num_tasks": await env.num_tasks("train"),
            "task1": (await env.get_task("train", 1)).task_spec,
            "range": [t.task_spec["id"] for t in await env.get_task_range("train", 1, 3)],
            "tools": sorted(t.name for t in await env.list_tools()),
        }
        tasks = await env.list_tasks("train")
        for task in tasks[:3]:
            await episode(env, record, task=task, secrets={"TOKEN": "s3cret"})
        await episode(env, record, split="holdout", index=0)
    else:
        from openreward.api.environments.client import AsyncEnvironmentsAPI

        api = AsyncEnvironmentsAPI(base_url=url, api_key="")
        env = api.get("arithenv", variant="arithenv")
        bare = api.get("arithenv")  # no variant: bare paths, served for the default environment
        discovery = {
            "splits": await env.list_splits(),
            "num_tasks": await env.num_tasks("train"),
            "task1": (await env.get_task("train", 1)).task_spec,
            "range": [t.task_spec["id"] for t in await env.get_task_range("train", 1, 3)],
            "tools": sorted(t.name for t in await env.list_tools()),
            "bare_splits": await bare.list_splits(),
        }
        tasks = await env.list_tasks("train")
        for task in tasks[:3]:  # openreward wants the domains a non-well-known secret may go to
            await episode(env, record, task=task, secrets={"TOKEN": ("s3cret", ["example.com"])})
        await episode(bare, record, split="holdout", index=0)
        async with env.session(task=tasks[0]) as session:
            messages = await session.get_messages()
            discovery["messages"] = [[m.role, blocks_text(m.blocks)] for m in messages]
            discovery["terminal"] = await session.is_assistant_message_final()
        if (
            len(sys.argv) > 3
        ):  # a plait server that also serves an environment with a @terminal tool
            term = api.get("finalanswerenv", variant="finalanswerenv")
            async with term.session(split="train", index=0) as session:
                discovery["terminal_env"] = {
                    "is_final": await session.is_assistant_message_final(),
                    "tools": sorted(t.name for t in await session.list_tools()),
                    "result": (await session.call_terminal_tool("The answer is 42")).reward,
                }
        await api.aclose()
    print(json.dumps({"discovery": discovery, "episodes": record}))


asyncio.run(main())
