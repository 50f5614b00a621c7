"""Word lists and sentence templates for the needle task's haystack (written for this benchmark).

The haystack must read as varied prose, not a repeated line, so that a needle is not found merely
because it breaks a pattern. Templates take only past-tense verbs and singular nouns, so any draw
is grammatical; none holds a digit, so the needle's number is the only number in the text.

Template fields: {adj} {adj2} {noun} {noun2} {verb} {verb2} {name} {name2} {place} {time} {Time} {adverb},
and {a_adj} / {a_noun}: the word with its article ("an amber", "a harbor").
"""

from __future__ import annotations

NOUNS = (
    "anchor", "apple", "apron", "arch", "arrow", "axe", "badge", "bag", "ball", "balloon", "banner",
    "barrel", "basket", "bead", "bell", "bench", "bicycle", "blanket", "boat", "bone", "book", "boot",
    "bottle", "bowl", "box", "bracelet", "branch", "bread", "brick", "bridge", "broom", "bucket",
    "button", "cabin", "cable", "cage", "cake", "camera", "candle", "cannon", "canoe", "canvas", "cap",
    "carpet", "cart", "castle", "chain", "chair", "chalk", "chest", "chimney", "clock", "cloak",
    "cloud", "coat", "coin", "comb", "compass", "cookie", "cord", "cottage", "crown", "cup", "curtain",
    "cushion", "desk", "diary", "dish", "door", "drum", "eagle", "engine", "envelope", "falcon",
    "feather", "fence", "fiddle", "flag", "flame", "flask", "flute", "fork", "fountain", "fox",
    "garden", "gate", "gem", "glove", "goat", "goblet", "guitar", "hammer", "harp", "hat", "helmet",
    "hive", "horn", "horse", "jacket", "jar", "jewel", "kettle", "key", "kite", "knife", "ladder",
    "lamp", "lantern", "leaf", "ledger", "lemon", "letter", "lever", "lily", "lion", "lock", "map",
    "marble", "mask", "medal", "melon", "mirror", "mitten", "needle", "nest", "net", "notebook", "oak",
    "oar", "orange", "otter", "owl", "paddle", "pail", "painting", "parcel", "pebble", "pen", "pencil",
    "piano", "pillow", "pipe", "plate", "plum", "pocket", "pony", "pot", "puzzle", "quill", "rabbit",
    "radio", "raft", "rake", "ribbon", "ring", "robe", "rocket", "rope", "rose", "saddle", "sail",
    "scarf", "scroll", "shell", "shield", "ship", "shovel", "sled", "slipper", "spoon", "stamp",
    "statue", "stone", "stool", "stove", "sword", "table", "tent", "thimble", "ticket", "tiger",
    "torch", "tower", "toy", "tray", "trumpet", "trunk", "tulip", "turtle", "umbrella", "vase",
    "violin", "wagon", "wallet", "whale", "whistle", "window", "wolf", "wreath", "yacht", "zebra",
)  # fmt: skip

ADJECTIVES = (
    "able", "amber", "ancient", "angry", "arctic", "ashen", "autumn", "bitter", "black", "blue",
    "bold", "brave", "bright", "brisk", "broad", "broken", "bronze", "busy", "calm", "careful",
    "cheerful", "chilly", "clever", "cloudy", "coastal", "cold", "copper", "cozy", "crimson",
    "crooked", "curious", "damp", "dark", "dazzling", "deep", "delicate", "distant", "dusty", "eager",
    "early", "elegant", "empty", "faded", "faint", "famous", "fancy", "fierce", "fine", "fragile",
    "fresh", "friendly", "frozen", "gentle", "giant", "gilded", "glassy", "gloomy", "glossy", "golden",
    "graceful", "grand", "gray", "green", "hollow", "honest", "humble", "icy", "idle", "jolly",
    "keen", "kind", "large", "late", "lazy", "leafy", "little", "lively", "lonely", "loud", "lucky",
    "marble", "mellow", "merry", "mighty", "misty", "modest", "muddy", "narrow", "neat", "nimble",
    "noble", "odd", "old", "orange", "pale", "patient", "plain", "polite", "proud", "purple", "quick",
    "quiet", "rapid", "rare", "restless", "rich", "rocky", "rosy", "rough", "round", "royal", "rusty",
    "sandy", "scarlet", "secret", "shady", "sharp", "shiny", "silent", "silver", "simple", "sleepy",
    "slender", "slow", "small", "smoky", "smooth", "snowy", "soft", "solemn", "sour", "spare",
    "stormy", "strange", "striped", "sturdy", "sudden", "sunny", "sweet", "swift", "tall", "tame",
    "tender", "tidy", "tiny", "tired", "trusty", "twisted", "upper", "urban", "vast", "velvet",
    "violet", "vivid", "warm", "wary", "weary", "wet", "white", "wide", "wild", "windy", "wise",
    "wooden", "woolen", "young", "zesty",
)  # fmt: skip

VERBS = (  # past tense, transitive
    "admired", "adopted", "balanced", "borrowed", "buried", "carried", "carved", "caught", "chased",
    "cleaned", "climbed", "collected", "copied", "counted", "covered", "crossed", "decorated",
    "delivered", "described", "discovered", "dragged", "drew", "dropped", "dusted", "examined",
    "fed", "fetched", "filled", "fixed", "folded", "followed", "found", "gathered", "greeted",
    "guarded", "guided", "held", "hid", "hugged", "ignored", "inspected", "kept", "kicked", "lifted",
    "loaded", "lost", "measured", "mended", "moved", "named", "noticed", "opened", "ordered",
    "packed", "painted", "passed", "photographed", "picked", "placed", "planted", "polished",
    "pulled", "pushed", "questioned", "raised", "reached", "recorded", "rediscovered", "remembered",
    "repaired", "rescued", "returned", "rolled", "sang about", "saved", "scrubbed", "searched",
    "selected", "sent", "shared", "sketched", "sold", "sorted", "spotted", "stacked", "studied",
    "swept", "tested", "tied", "touched", "towed", "traded", "trimmed", "unwrapped", "visited",
    "warmed", "washed", "watched", "weighed", "welcomed", "wrapped", "wrote about",
)  # fmt: skip

NAMES = (
    "Ada", "Alma", "Arthur", "Beatrice", "Bruno", "Camille", "Clara", "Cyrus", "Dalia", "Dmitri",
    "Edgar", "Elena", "Elif", "Felix", "Freya", "Gideon", "Greta", "Hana", "Hugo", "Ines", "Ivan",
    "Jonas", "Juno", "Kai", "Keiko", "Lars", "Leila", "Lena", "Luca", "Mabel", "Malik", "Marta",
    "Milo", "Nadia", "Nico", "Nora", "Olga", "Omar", "Oscar", "Petra", "Pia", "Quentin", "Rafael",
    "Rosa", "Rufus", "Sana", "Silas", "Sofia", "Tariq", "Thea", "Tobias", "Uma", "Viktor", "Vera",
    "Wendell", "Willa", "Xavier", "Yara", "Yusuf", "Zara",
)  # fmt: skip

PLACES = (
    "attic", "bakery", "barn", "bay", "canyon", "cellar", "chapel", "cliff", "courtyard", "harbor",
    "hallway", "hill", "island", "kitchen", "lake", "library", "lighthouse", "market", "meadow",
    "mill", "monastery", "museum", "observatory", "orchard", "palace", "park", "pier", "plaza",
    "pond", "quarry", "ravine", "river", "riverbank", "school", "shore", "square", "stable",
    "station", "studio", "swamp", "temple", "theater", "valley", "village", "vineyard", "warehouse",
    "workshop", "forest", "desert", "glacier", "greenhouse", "tavern", "inn", "bazaar", "garage",
)  # fmt: skip

TIMES = (
    "at dawn", "at dusk", "at midnight", "at noon", "before breakfast", "after supper",
    "in the morning", "in the evening", "on a rainy day", "during the festival", "last winter",
    "last summer", "early in spring", "late in autumn", "after the storm", "before the harvest",
    "on a quiet afternoon", "during the long journey", "in the old days", "that same week",
)  # fmt: skip

ADVERBS = (
    "slowly", "quickly", "carefully", "quietly", "gladly", "boldly", "gently", "proudly", "warily",
    "eagerly", "patiently", "calmly", "briskly", "cheerfully", "clumsily", "gracefully", "happily",
    "hastily", "honestly", "kindly", "lazily", "loudly", "neatly", "nervously", "openly", "politely",
    "promptly", "rarely", "secretly", "softly", "solemnly", "steadily", "swiftly", "tenderly",
    "thoughtfully", "wisely", "silently", "anxiously", "brightly", "freely",
)  # fmt: skip

TEMPLATES = (
    "The {adj} {noun} {verb} the {noun2} near the {place}.",
    "{name} {verb} {a_adj} {noun} {time}.",
    "Nobody expected the {noun} in the {place} to look so {adj}.",
    "In the {place}, {a_adj} {noun} {verb} every {noun2} it could find.",
    "{name} and {name2} {verb} the {adj} {noun} {adverb}.",
    "{Time}, the {adj} {noun} {verb} the {noun2}.",
    "Every {noun} in the {place} looked {adj} {time}.",
    "{name} once said that {a_adj} {noun} is better than {a_noun}.",
    "The {noun} {verb} the {noun2} {adverb} and then rested by the {place}.",
    "Near the {place}, {name} found {a_adj} {noun} beside the {adj2} {noun2}.",
    "Some people believe the {noun} {verb} the {noun2} long ago.",
    "Why the {noun} {verb} the {noun2} remains {a_adj} question.",
    "{name} wrote {a_adj} letter about the {noun} in the {place}.",
    "There was {a_adj} {noun} on the table, and {name} {verb} it {adverb}.",
    "The story of the {adj} {noun} is told in every {place}.",
    "After the {noun} {verb} the {noun2}, the {place} grew {adj}.",
    "{name} {verb} the {noun} because it seemed {adj}.",
    "The {adj} {noun} belonged to {name}, who kept it in the {place}.",
    "Few travellers remember the {adj} {noun} of the {place}.",
    "The {noun} and the {noun2} were both {adj} {time}.",
    "Under {a_adj} sky, {name} {verb} {a_noun} {adverb}.",
    "The old {noun} {verb} the {adj} {noun2} without a sound.",
    "It is said that the {place} hides {a_adj} {noun}.",
    "{name} laughed when the {noun} {verb} the {noun2}.",
    "Each {noun} has its own {adj} {noun2}, or so {name} claimed.",
    "The {adj} {noun} waited {adverb} by the {place}.",
    "When {name} {verb} the {noun}, everyone in the {place} felt {adj}.",
    "{Time}, {name} {adverb} {verb} the {adj2} {noun} from the {place}.",
    "A letter from {name2} described {a_adj} {noun} and {a_noun}.",
    "The children of the {place} {verb} the {adj} {noun} {time}.",
    "No one in the {place} knew who had left the {adj} {noun} there.",
    "{name} {verb} the {noun2} while {name2} {verb2} the {adj} {noun}.",
)
