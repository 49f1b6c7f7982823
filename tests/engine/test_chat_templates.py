"""Chat-template render workers: a render whose client leaves gives its worker back to the pool
(issue 21: 100 clients giving up at once replaced every worker, and the next chat request waited
seconds for a fresh one to import transformers and load its tokenizer)."""

from __future__ import annotations

import asyncio

from compiled_llm.engine.chat_templates import ChatTemplateRenderer

LONG = [{"role": "user", "content": "Write a long story. " * 400}]


def test_clients_leaving_mid_render_keep_their_workers(real_model_path):
    async def main() -> None:
        renderer = ChatTemplateRenderer(real_model_path, num_workers=2)
        try:
            await asyncio.gather(renderer.render(LONG), renderer.render(LONG))  # both workers loaded
            pids = sorted(worker.proc.pid for worker in renderer._workers)
            for _ in range(3):
                renders = [asyncio.create_task(renderer.render(LONG)) for _ in range(20)]
                # Both workers busy with a render. (Polling for that alone could miss every such
                # moment: once all 20 renders were done the pool stayed full and the loop spun
                # forever, which hung a CI run; the renders then simply finish.)
                while renderer._pool().qsize() and not all(render.done() for render in renders):
                    await asyncio.sleep(0.001)
                for render in renders:
                    render.cancel()
                await asyncio.gather(*renders, return_exceptions=True)
                # The cancelled renders' workers come back before the next round starts.
                await asyncio.wait_for(asyncio.gather(*renderer._reclaiming), 30)
            assert "Write a long story" in await asyncio.wait_for(renderer.render(LONG), 30)
            assert sorted(worker.proc.pid for worker in renderer._workers) == pids
            assert all(worker.proc.is_alive() for worker in renderer._workers)
        finally:
            renderer.shutdown()

    asyncio.run(main())
