"""The official `openai` package against `voxkernel serve`: streamed speech as pcm, wav and SSE,
and its error handling. Usage: openai_speech.py BASE_URL (e.g. http://127.0.0.1:8000/v1); the
server runs with --api-key test-key. Prints one JSON line of what it received."""

import base64
import json
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="test-key", max_retries=0)
report = {}

with client.audio.speech.with_streaming_response.create(
    model="tts-1", voice="ryan", input="Hello from the openai package.", response_format="pcm"
) as response:
    assert response.headers["content-type"] == "audio/pcm", response.headers
    chunks = list(response.iter_bytes())
report["pcm_bytes"] = sum(len(c) for c in chunks)

with client.audio.speech.with_streaming_response.create(
    model="tts-1", voice="ryan", input="Now as a WAV stream.", response_format="wav"
) as response:
    wav = response.read()
assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE", wav[:44]
report["wav_bytes"] = len(wav)

with client.audio.speech.with_streaming_response.create(
    model="tts-1",
    voice="ryan",
    input="And as server-sent events.",
    response_format="pcm",
    stream_format="sse",
) as response:
    audio = b""
    done = None
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if event["type"] == "speech.audio.delta":
            audio += base64.b64decode(event["audio"])
        elif event["type"] == "speech.audio.done":
            done = event
assert done is not None
report["sse_audio_bytes"] = len(audio)
report["sse_output_tokens"] = done["usage"]["output_tokens"]

try:
    client.audio.speech.create(model="tts-1", voice="ryan", input="x", response_format="mp3")
except openai.BadRequestError as e:
    assert "response_format" in str(e), e
    report["bad_format_status"] = e.status_code

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
except openai.AuthenticationError as e:
    report["no_key_status"] = e.status_code

print(json.dumps(report))
