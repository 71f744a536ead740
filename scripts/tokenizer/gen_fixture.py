"""Generate tests/fixtures/tokenizer/tokenizer_cases.json with the official tokenizer.

Run with the reference venv (transformers 4.57.3, tokenizers 0.22.1):

    /work/refenv/bin/python scripts/tokenizer/gen_fixture.py

For every case string it records the ids that transformers' Qwen2TokenizerFast gives, loaded the
way that is equivalent to loading by hub id (the Qwen split regex), and the ids that the
fix_mistral_regex=True local-directory load gives (the Mistral split regex). See
docs/tokenizer.md for why the two loads differ and why the hub-id behaviour is the target.
"""

import argparse
import json
import os
import shutil
import tempfile
import unicodedata
from pathlib import Path

# No network: the loads below must not depend on the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import Qwen2TokenizerFast  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "tokenizer"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")

QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MISTRAL_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def nfd(s: str) -> str:
    return unicodedata.normalize("NFD", s)


# (category, text). Categories name what a case exercises; the Rust test uses them only in
# messages, except "regex_*" ones, which docs/tokenizer.md cites.
CASES = [
    # Chinese
    ("zh", "你好，世界！"),
    ("zh", "今天天气很好，我们去公园散步吧。"),
    ("zh", "我爱北京天安门。"),
    ("zh", "他说：“这件事情我已经知道了。”"),
    ("zh", "人工智能正在改变我们的生活方式，尤其是在语音合成领域。"),
    ("zh", "请在2024年3月15日之前提交报告。"),
    ("zh", "这个价格是¥1,299.00元，含税。"),
    ("zh", "四川话和北京话听起来很不一样哦～"),
    ("zh", "《红楼梦》是中国古典小说的巅峰之作。"),
    ("zh", "Qwen3-TTS支持十种语言。"),
    # English
    ("en", "Hello, world!"),
    ("en", "The quick brown fox jumps over the lazy dog."),
    ("en", "She sells sea shells by the sea shore."),
    ("en", "It's 7:45 p.m. and the meeting hasn't started yet."),
    ("en", "Please call me at (555) 123-4567 or email test@example.com."),
    ("en", "Supercalifragilisticexpialidocious is a very long word."),
    ("en", "Dr. Smith earned $1,234.56 on Jan. 5th, 2023."),
    ("en", "  Leading spaces and trailing spaces  "),
    ("en", "Multiple     internal     spaces."),
    ("en", "Tabs\tbetween\twords."),
    # Japanese
    ("ja", "こんにちは、世界！"),
    ("ja", "今日はとても良い天気ですね。"),
    ("ja", "東京タワーは333メートルです。"),
    ("ja", "カタカナとひらがなと漢字が混ざった文章。"),
    ("ja", "ｶﾀｶﾅ半角もあります。"),
    ("ja", "「ありがとうございます」と彼女は言った。"),
    ("ja", "お疲れ様でした〜また明日！"),
    # Korean
    ("ko", "안녕하세요, 세계!"),
    ("ko", "오늘 날씨가 정말 좋네요."),
    ("ko", "저는 서울에서 왔습니다."),
    ("ko", "한국어 음성 합성은 어렵지 않아요?"),
    ("ko", "가격은 15,000원입니다."),
    ("ko", nfd("한글 자모 분해 테스트")),
    # German
    ("de", "Guten Tag! Wie geht es Ihnen?"),
    ("de", "Die Straße ist sehr schön."),
    ("de", "Donaudampfschifffahrtsgesellschaftskapitänsmütze"),
    ("de", "Über den Wolken muss die Freiheit wohl grenzenlos sein."),
    ("de", "Größe, Maß und Fußgängerübergänge."),
    ("de", "Das kostet 3,50 €."),
    # French
    ("fr", "Bonjour, comment ça va ?"),
    ("fr", "L'été dernier, j'ai visité Paris."),
    ("fr", "C'est à côté de l'hôpital, n'est-ce pas ?"),
    ("fr", "« Je ne sais pas », répondit-elle."),
    ("fr", "Où est la bibliothèque ? Là-bas !"),
    ("fr", "Qu'est-ce qu'il y a ? Œuvre, cœur, naïve."),
    # Russian
    ("ru", "Привет, мир!"),
    ("ru", "Как у тебя дела сегодня?"),
    ("ru", "Съешь же ещё этих мягких французских булок, да выпей чаю."),
    ("ru", "Москва — столица России."),
    ("ru", "Ёлка стоит в углу комнаты."),
    ("ru", "В 2023 году было 365 дней."),
    # Portuguese
    ("pt", "Olá, tudo bem?"),
    ("pt", "A ação foi concluída com sucesso."),
    ("pt", "Não sei o que você está dizendo."),
    ("pt", "São Paulo é a maior cidade do Brasil."),
    ("pt", "Coração, pão, mãe e irmã."),
    ("pt", "Ele comprou três maçãs por R$ 5,00."),
    # Spanish
    ("es", "¡Hola! ¿Cómo estás?"),
    ("es", "El niño comió una manzana."),
    ("es", "Mañana iremos a la montaña."),
    ("es", "¿Dónde está la estación de tren?"),
    ("es", "Años atrás, el pingüino vivía en Antártida."),
    ("es", "El 25% de los participantes llegó tarde."),
    # Italian
    ("it", "Ciao, come stai?"),
    ("it", "Perché non vieni con noi?"),
    ("it", "L'università è chiusa oggi."),
    ("it", "Più tardi andrò al caffè."),
    ("it", "C'era una volta un re che aveva tre figlie."),
    ("it", "Sì, è così: però non è colpa mia."),
    # Digits and numbers
    ("digits", "0"),
    ("digits", "1234567890"),
    ("digits", "3.14159265358979"),
    ("digits", "1,000,000"),
    ("digits", "-42 + 17 = -25"),
    ("digits", "2024-03-15T12:34:56Z"),
    ("digits", "Call 911 now."),
    ("digits", "x² + y² = z²"),
    ("digits", "½ ¼ ¾ Ⅻ ① ٣ ४"),
    ("digits", "１２３４５"),
    # Emoji
    ("emoji", "😀"),
    ("emoji", "I love you ❤️"),
    ("emoji", "👨‍👩‍👧‍👦 family"),
    ("emoji", "👍🏻👍🏼👍🏽👍🏾👍🏿"),
    ("emoji", "🏳️‍🌈 and 🏴‍☠️"),
    ("emoji", "👩🏽‍💻 is coding 🚀🚀🚀"),
    ("emoji", "🇨🇳🇺🇸🇯🇵🇰🇷🇩🇪"),
    ("emoji", "Great job!🎉🎉"),
    ("emoji", "1️⃣ 2️⃣ #️⃣"),
    # Combining accents: NFC and NFD inputs of the same text
    ("nfc", "café naïve résumé"),
    ("nfd", nfd("café naïve résumé")),
    ("nfc", "Ångström"),
    ("nfd", nfd("Ångström")),
    ("nfc", "Việt Nam"),
    ("nfd", nfd("Việt Nam")),
    ("nfd", nfd("L'été dernier, j'ai visité Paris.")),
    ("nfd", nfd("São Paulo é a maior cidade do Brasil.")),
    ("nfd", nfd("Ёлка")),
    ("nfd", "e\u0301\u0302 stacked marks"),
    ("nfd", "a\u030a\u0323"),
    ("nfd", nfd("がぎぐげご")),
    # Full-width characters
    ("fullwidth", "ＡＢＣ ａｂｃ"),
    ("fullwidth", "Ｈｅｌｌｏ，Ｗｏｒｌｄ！"),
    ("fullwidth", "（注意）：全角括号和冒号"),
    ("fullwidth", "　全角空格　"),
    # Mixed case: the Qwen and Mistral regexes split these differently
    ("regex_mixed_case", "iPhone"),
    ("regex_mixed_case", "I bought a new iPhone yesterday."),
    ("regex_mixed_case", "OpenAI"),
    ("regex_mixed_case", "OpenAI released GPT-4."),
    ("regex_mixed_case", "McDonald's"),
    ("regex_mixed_case", "JavaScript and TypeScript"),
    ("regex_mixed_case", "camelCaseIdentifier"),
    ("regex_mixed_case", "HTTPServer"),
    ("regex_mixed_case", "NASA and FBI"),
    ("regex_mixed_case", "YouTube, PayPal, eBay"),
    ("regex_mixed_case", "iOS"),
    ("regex_mixed_case", "ChatGPT"),
    ("regex_mixed_case", "DeepSeek and macOS"),
    # Contractions
    ("contractions", "don't won't can't shouldn't"),
    ("contractions", "I'm you're we've they'll she'd"),
    ("contractions", "IT'S ALL CAPS, I'M SHOUTING"),
    ("contractions", "rock 'n' roll"),
    ("contractions", "the '90s"),
    ("regex_apostrophe_s", "'sup"),
    ("regex_apostrophe_s", "What'sup dude"),
    ("regex_apostrophe_s", "let'sgo"),
    ("regex_apostrophe_s", "he'sgreat"),
    ("regex_apostrophe_s", "'Sup"),
    ("regex_apostrophe_s", "'tis the season"),
    ("contractions", "It’s a curly apostrophe."),
    # Leading / trailing whitespace and newlines
    ("whitespace", " "),
    ("whitespace", "  "),
    ("whitespace", "\n"),
    ("whitespace", "\n\n"),
    ("whitespace", "\t"),
    ("whitespace", " Hello"),
    ("whitespace", "Hello "),
    ("whitespace", "\nHello"),
    ("whitespace", "Hello\n"),
    ("whitespace", "\n\nHello\n\n"),
    ("whitespace", "Line one\nLine two\nLine three"),
    ("whitespace", "Paragraph one.\n\nParagraph two."),
    ("whitespace", "   \n   indented\n"),
    ("whitespace", "trailing spaces then newline   \n"),
    # CRLF
    ("crlf", "Hello\r\nWorld"),
    ("crlf", "\r\n"),
    ("crlf", "one\r\ntwo\r\n\r\nthree\r\n"),
    ("crlf", "old mac\rline"),
    # Punctuation only
    ("punct", "."),
    ("punct", "..."),
    ("punct", "!?!?"),
    ("punct", "—"),
    ("punct", "“”‘’"),
    ("punct", "。，、！？"),
    ("punct", "()[]{}<>"),
    ("punct", "@#$%^&*_+=|\\/~`"),
    ("punct", "-- -- --"),
    ("punct", "://"),
    # Special-token literals inside the text
    ("special", "<|im_end|>"),
    ("special", "Hello<|im_end|>world"),
    ("special", "<|im_start|>user\nhi<|im_end|>"),
    ("special", "<tts_pad>"),
    ("special", "a<tts_pad>b<tts_text_bos>c<tts_text_eod>"),
    ("special", "<|endoftext|>"),
    ("special", "<|audio_start|><|audio_pad|><|audio_end|>"),
    ("special", "<think>reasoning</think>"),
    ("special", "<tool_call>{}</tool_call>"),
    ("special", " <|im_end|> "),
    ("special", "<|im_end"),
    ("special", "<tts_pad"),
    ("special", "<|IM_END|>"),
    # Very long words and repetition
    ("long", "a" * 300),
    ("long", "ab" * 200),
    ("long", "Pneumonoultramicroscopicsilicovolcanoconiosis"),
    ("long", "哈" * 120),
    ("long", "1" * 100),
    ("long", "!" * 80),
    ("long", " " * 50),
    ("long", "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 8),
    # Empty-ish
    ("empty", ""),
    ("empty", "\u200b"),
    ("empty", "\u00a0"),
    ("empty", "\ufeff"),
    # Mixed languages and scripts
    ("mixed", "Hello 你好 こんにちは 안녕하세요 Привет"),
    ("mixed", "我用iPhone打电话给OpenAI的朋友。"),
    ("mixed", "Die Zahl ist 42, 对吧？"),
    ("mixed", "Ελληνικά και עברית و العربية"),
    ("mixed", "हिन्दी और ไทย"),
    ("mixed", "Control\x00chars\x07here"),
    ("mixed", "URL: https://example.com/path?q=1&r=2#frag"),
    ("mixed", "C:\\Users\\name\\file.txt"),
    ("mixed", "def f(x):\n    return x * 2\n"),
]


def load_tokenizer(directory: Path) -> Qwen2TokenizerFast:
    return Qwen2TokenizerFast.from_pretrained(str(directory), fix_mistral_regex=True)


def split_regex(tokenizer: Qwen2TokenizerFast) -> str:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    return state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]


def load_hub_equivalent(fixture_dir: Path) -> Qwen2TokenizerFast:
    """The hub-id load, reproduced offline.

    _patch_mistral_regex (transformers 4.57.3, tokenization_utils_base.py) only swaps the regex
    when a config.json is found beside the tokenizer (local directory) or when the hub tags say
    the model derives from mistralai. The fixture directory holds no config.json, so, like the
    hub-id load of a non-Mistral repository, the patch leaves the converted tokenizer as is even
    with fix_mistral_regex=True.
    """
    assert not (fixture_dir / "config.json").exists(), "the fixture dir must hold no config.json"
    tokenizer = load_tokenizer(fixture_dir)
    assert split_regex(tokenizer) == QWEN_REGEX, split_regex(tokenizer)
    return tokenizer


def check_hub_id_path(fixture_dir: Path) -> None:
    """Run the hub-id branch of _patch_mistral_regex offline and check it keeps the Qwen regex.

    For a hub id, _patch_mistral_regex only asks huggingface_hub.model_info whether the repository's
    tags match "base_model:.*mistralai". The tags below stand in for the Qwen3-TTS repository's
    (an assumption; what matters is that none names mistralai).
    """
    import huggingface_hub

    class ModelInfo:
        tags = ["transformers", "safetensors", "qwen3_tts", "text-to-speech", "license:apache-2.0"]

    real_model_info = huggingface_hub.model_info
    huggingface_hub.model_info = lambda model_id: ModelInfo()
    try:
        tokenizer = load_tokenizer(fixture_dir)
        patched = Qwen2TokenizerFast._patch_mistral_regex(
            tokenizer,
            "Qwen/Qwen3-TTS-12Hz-0.6B-Base",
            _is_local=False,
            fix_mistral_regex=True,
        )
    finally:
        huggingface_hub.model_info = real_model_info
    assert split_regex(patched) == QWEN_REGEX, split_regex(patched)


def load_local_mistral(fixture_dir: Path, scratch: Path) -> Qwen2TokenizerFast:
    """What qwen-tts gets from a local checkpoint directory saved by transformers 4.57.3."""
    for name in TOKENIZER_FILES:
        shutil.copy(fixture_dir / name, scratch / name)
    config = {"model_type": "qwen3_tts", "transformers_version": "4.57.3"}
    (scratch / "config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(scratch)
    assert split_regex(tokenizer) == MISTRAL_REGEX, split_regex(tokenizer)
    return tokenizer


def ids(tokenizer: Qwen2TokenizerFast, s: str) -> list[int]:
    # The same call Qwen3TTSProcessor makes (default add_special_tokens, which Qwen2 ignores).
    return tokenizer(s)["input_ids"]


def pretokens(tokenizer: Qwen2TokenizerFast, s: str) -> list[str]:
    """The pieces of the split regex after NFC, in the byte-level alphabet (before BPE)."""
    backend = tokenizer.backend_tokenizer
    normalized = backend.normalizer.normalize_str(s)
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]


def case_record(qwen, mistral, category: str, text: str) -> dict:
    target_chat = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    reference_chat = f"<|im_start|>assistant\n{text}<|im_end|>\n"
    instruct_chat = f"<|im_start|>user\n{text}<|im_end|>\n"
    target_chat_ids = ids(qwen, target_chat)
    assert target_chat_ids == qwen(target_chat, add_special_tokens=False)["input_ids"]
    return {
        "category": category,
        "text": text,
        "encode_ids": ids(qwen, text),
        "target_chat_ids": target_chat_ids,
        "target_text_ids": target_chat_ids[3:-5],
        "reference_text_ids": ids(qwen, reference_chat)[3:-2],
        "instruct_ids": ids(qwen, instruct_chat),
        "mistral_target_chat_ids": ids(mistral, target_chat),
        "qwen_pretokens": pretokens(qwen, text),
        "mistral_pretokens": pretokens(mistral, text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture-dir", type=Path, default=FIXTURE_DIR)
    args = parser.parse_args()

    texts = [text for _, text in CASES]
    assert len(set(texts)) == len(texts), "duplicate case strings"

    check_hub_id_path(args.fixture_dir)
    qwen = load_hub_equivalent(args.fixture_dir)
    with tempfile.TemporaryDirectory() as scratch:
        mistral = load_local_mistral(args.fixture_dir, Path(scratch))
        records = [case_record(qwen, mistral, category, text) for category, text in CASES]

    fixture = {
        "generator": "scripts/tokenizer/gen_fixture.py",
        "transformers_version": __import__("transformers").__version__,
        "tokenizers_version": __import__("tokenizers").__version__,
        "qwen_split_regex": QWEN_REGEX,
        "mistral_split_regex": MISTRAL_REGEX,
        "cases": records,
    }
    out = args.fixture_dir / "tokenizer_cases.json"
    out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")

    print(f"wrote {len(records)} cases to {out}")
    split_differs = [r for r in records if r["qwen_pretokens"] != r["mistral_pretokens"]]
    print(f"{len(split_differs)} cases split differently under the Mistral regex:")
    for record in split_differs:
        ids_differ = record["target_chat_ids"] != record["mistral_target_chat_ids"]
        verdict = "ids differ" if ids_differ else "same ids"
        print(f"  [{record['category']}] {record['text']!r}: {verdict}")


if __name__ == "__main__":
    main()
