"""Who is in the job, as this rank sees it: the one record the membership's parts read together.

    roster = Roster(me)          me: this rank's id for the whole job (its rank in the first generation)
    with roster.lock: ...        the detector's threads and the training thread read and change it under it
    roster.move(State.X)         the one place the membership's state changes (utils/elastic/agreement.TRANSITIONS)
    roster.adopt(decision)       a formed generation's members and book

The detector (heartbeats), the agreement and the growth (joins) are each handed this one roster;
what each of them knows beyond it is its own.
"""

import threading

from utils.elastic import agreement
from utils.elastic.agreement import State


class Roster:
    """This rank's id, the members of its generation and their book, the membership's state, and
    the lock under which all of them (and the parts' own state) are read and changed."""

    def __init__(self, me):
        self.me = me
        self.lock = threading.Lock()
        self.book, self.token = {}, None  # id -> {"address", "pid", "host"}; the job's random id
        self.generation, self.members = 0, []
        self.state = State.TRAINING
        self.forming = ()  # while a group forms (Membership.join): its members

    def move(self, to):
        """The one place the state changes (under the lock)."""
        self.state = agreement.move(self.state, to)

    def rank_of(self, member):
        return self.members.index(member)

    def leads(self):
        """Whether this rank is the first of its generation (the one that decides a growth)."""
        return bool(self.members) and self.members[0] == self.me

    def adopt(self, decision):
        """A formed generation (a wire.Decision): its members and book become this rank's (under
        the lock). Returns the ids whose book entry changed (a new server under an old id)."""
        self.generation, self.members = decision.g, decision.members
        changed = []
        for m, entry in decision.book.items():
            if self.book.get(int(m)) != entry:
                changed.append(int(m))
            self.book[int(m)] = entry
        if self.state != State.FENCED:
            self.move(State.TRAINING)
        return changed
